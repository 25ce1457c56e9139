"""The synchronous, in-process engine behind the offline ``LLM``: front end + engine core in one
process, stepped by the caller. One engine core only: data parallelism (several engine cores)
is ``kiln serve --data-parallel-size N``'s, and is refused here.

A step that raises (an error in shared state: the scheduler, the model, the sampler; errors of
one request fail that request only) kills the engine, as the server's engine core dies: the step
raises ``EngineDeadError`` from the error, and so does every later ``add_request`` and ``step``,
instead of going on with requests in an unknown state."""

from __future__ import annotations

from kiln.config import KilnConfig
from kiln.engine.core import EngineCore
from kiln.engine.frontend import Frontend
from kiln.engine.input_processor import PromptType
from kiln.engine.stats import StatsRecorder
from kiln.lora.request import LoRARequest
from kiln.messages import EngineDeadError
from kiln.outputs import RequestOutput
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams


class LLMEngine:
    """Args:
    config: the platform-updated config (``init_process`` has run in this process).
    log_stats: log throughput and cache statistics every 10 s while busy.
    """

    def __init__(self, config: KilnConfig, log_stats: bool = True) -> None:
        """Raises:
        ValueError: ``parallel.data_parallel_size`` above 1.
        """
        if config.parallel.data_parallel_size != 1:
            raise ValueError(
                f"parallel.data_parallel_size={config.parallel.data_parallel_size} is not "
                "supported by the offline LLM, which steps one engine core in the caller's "
                "process; allowed: 1 (serve several engines with kiln serve --data-parallel-size)"
            )
        self.engine_core = EngineCore(config)
        self.config = self.engine_core.config
        self.frontend = Frontend(self.config, self.engine_core.max_model_len)
        self.stats = StatsRecorder(10.0 if log_stats else 0.0)
        self.dead_error: str | None = None
        """Why the engine died (a step raised), or None."""

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a request (a pooling one with ``pooling_params``).

        Raises:
            ValueError: an invalid prompt, params or adapter.
            EngineDeadError: an earlier step failed.
        """
        self._check_alive()
        requests = self.frontend.make_requests(
            request_id,
            prompt,
            params,
            priority,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        for request in requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        core_ids = self.frontend.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.frontend.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that advanced.

        Raises:
            EngineDeadError: this step or an earlier one failed (see the module doc).
        """
        self._check_alive()
        try:
            outputs = self.engine_core.step()
        except Exception as exc:
            self.dead_error = f"an engine step failed: {type(exc).__name__}: {exc}"
            raise EngineDeadError(self.dead_error) from exc
        processed = self.frontend.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        self.stats.record(outputs.scheduler_stats, processed.iteration_stats)
        return processed.request_outputs

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")

    def shutdown(self) -> None:
        self.engine_core.shutdown()
