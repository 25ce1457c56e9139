"""The model runner's optional stages: a feature of the step is a class, not a branch in it.

A ``RunnerStage`` hears about the runner's set-up (the model loaded, the KV cache sized and
allocated) and the batch's diff (requests added, removed), and may prepare each step before the
forward (``before_forward``). The base class does nothing at every hook: it is the null stage a
runner holds where a feature is off, so the step never asks whether a feature is on. The runner
calls every stage's hook in its ``stages`` order.

Stages here: ``LoRAStage`` (a step's adapter slots), ``KVConnectorStage`` (a KV connector's loads
and saves around the forward), ``PromptLogprobs`` (prompt logprobs gathered over prefill chunks)
and ``GrammarMask`` (the scheduler's grammar bitmask over the logits). The
sampling strategies (``kiln.worker.sampling``) are stages too.

A stage knows the part of the step it serves and nothing of scheduling policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.kv_transfer import KVConnectorBase
from kiln.lora.model_manager import LoRAModelManager
from kiln.messages import KVConnectorOutput, LogprobsLists, NewRequestData
from kiln.model_executor.layers.token_bitmask import ApplyTokenBitmask
from kiln.sampling.sampler import compute_prompt_logprobs

if TYPE_CHECKING:
    from collections.abc import Callable

    from kiln.worker.step_plan import StepPlan


class RunnerStage:
    """An optional part of the runner's step; every hook of this class does nothing."""

    def load_model(self, model: Any, platform: Any) -> None:
        """The target model is loaded (``platform``: the process's)."""

    def get_kv_cache_bytes_per_block(self) -> int:
        """KV-cache bytes this stage adds to every block (a draft model's cache)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The KV cache of ``num_blocks`` blocks is allocated."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        """The target's caches by layer name (dimension ``block_dim`` indexes blocks)."""

    def add_requests(self, new_reqs: list[NewRequestData]) -> None:
        """New or resumed requests joined the batch (a resumed one starts afresh)."""

    def remove_requests(self, req_ids: list[str]) -> None:
        """Finished or preempted requests left the batch (unknown ids are ignored)."""

    def before_forward(self, plan: StepPlan) -> None:
        """Prepare the step's forward; a request that fails here goes into
        ``plan.failed_requests``."""

    def after_forward(self, plan: StepPlan) -> None:
        """The forward has written the step's keys and values (before sampling)."""

    def without_forward(self, metadata: Any) -> KVConnectorOutput | None:
        """A step that scheduled no tokens (the KV connector's ``metadata``): transfers in the
        background still advance; their report, or None."""
        return None


class LoRAStage(RunnerStage):
    """LoRA: every step's adapters in their slots before the forward (``LoRAModelManager``)."""

    def __init__(self, manager: LoRAModelManager) -> None:
        self.manager = manager

    def add_requests(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self.manager.add_request(new.req_id, new.lora_request)

    def remove_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.manager.remove_request(req_id)

    def before_forward(self, plan: StepPlan) -> None:
        plan.failed_requests.update(self.manager.set_active_loras(plan.req_ids, plan.num_scheduled))


class KVConnectorStage(RunnerStage):
    """A KV connector's worker side around the forward (``kiln.kv_transfer``): the step's
    loads before it, its saves after it, and the report for the scheduler."""

    def __init__(self, connector: KVConnectorBase) -> None:
        self.connector = connector
        self._finished: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        self.connector.register_kv_caches(kv_caches, block_dim)

    def remove_requests(self, req_ids: list[str]) -> None:
        self._finished.update(req_ids)

    def before_forward(self, plan: StepPlan) -> None:
        connector = self.connector
        connector.bind_connector_metadata(plan.scheduler_output.kv_connector_metadata)
        connector.start_load_kv()
        if connector.uses_layer_hooks:
            plan.kv_connector = connector

    def after_forward(self, plan: StepPlan) -> None:
        plan.kv_connector_output = self._report()

    def without_forward(self, metadata: Any) -> KVConnectorOutput:
        """The connector's hooks of a step, without its forward: asynchronous transfers start,
        finish and are reported while no request runs."""
        self.connector.bind_connector_metadata(metadata)
        self.connector.start_load_kv()
        return self._report()

    def _report(self) -> KVConnectorOutput:
        """After the forward (or in its place): the step's saves, then the report."""
        connector = self.connector
        connector.wait_for_save()
        finished, self._finished = self._finished, set()
        sending, recving = connector.get_finished(finished)
        report = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            stats=connector.take_stats(),
        )
        connector.clear_connector_metadata()
        return report


class PromptLogprobs(RunnerStage):
    """Prompt logprobs: position ``p`` predicts prompt token ``p + 1``; a request's chunks are
    gathered until its prefill finishes, then returned whole (``P - 1`` rows)."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[LogprobsLists]] = {}

    def remove_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._chunks.pop(req_id, None)

    def compute(
        self,
        plan: StepPlan,
        hidden_states: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, LogprobsLists]:
        """The complete prompt logprobs of the requests whose prefill finished this step and
        that asked; gathers this step's chunk of the others. ``hidden_states``: [T, hidden]."""
        batch = plan.batch
        result: dict[str, LogprobsLists] = {}
        states = [batch.requests[row] for row in plan.rows]
        if all(state.sampling_params.prompt_logprobs is None for state in states):
            return result  # the common case: no per-step work
        starts = plan.common.query_start_loc.tolist()
        for i, row in enumerate(plan.rows):
            state = batch.requests[row]
            num_prompt = int(batch.num_prompt_tokens[row])
            start = int(plan.common.num_computed_tokens[i])
            if state.sampling_params.prompt_logprobs is None or start >= num_prompt:
                continue
            end = min(start + int(plan.num_scheduled[i]), num_prompt - 1)  # last with a target
            chunks = self._chunks.setdefault(state.req_id, [])
            if end > start:
                logits = compute_logits(hidden_states[starts[i] : starts[i] + end - start])
                targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1])
                num_logprobs = state.sampling_params.prompt_logprobs
                lists = compute_prompt_logprobs(logits, targets, num_logprobs).tolists()
                chunks.append(LogprobsLists(*lists))
            if start + int(plan.num_scheduled[i]) >= num_prompt:
                result[state.req_id] = LogprobsLists.concat(self._chunks.pop(state.req_id))
        return result


class GrammarMask:
    """Structured outputs: forbid what each grammar forbids, before the sampler, so logprobs see
    the masked distribution too (as vLLM applies it before its sampler). A step without
    structured requests (no ``grammar_bitmask``) passes its logits through."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.apply_token_bitmask = ApplyTokenBitmask()

    def __call__(self, logits: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """``logits`` [P, V] masked. A structured request has a bitmask row per logits row (its
        last position, or with ``k`` drafts its last ``1 + k``), in the same order."""
        scheduler_output = plan.scheduler_output
        if scheduler_output.grammar_bitmask is None:
            return logits
        index = {req_id: i for i, req_id in enumerate(plan.req_ids)}
        masked_rows: list[int] = []
        for req_id in scheduler_output.structured_output_request_ids:
            start = int(plan.logits_starts[index[req_id]])
            masked_rows.extend(range(start, start + int(plan.num_positions[index[req_id]])))
        assert len(masked_rows) == len(scheduler_output.grammar_bitmask), "a row per position"
        bitmask = torch.from_numpy(scheduler_output.grammar_bitmask).to(self.device)
        masked_rows_t = torch.tensor(masked_rows, dtype=torch.int64).to(self.device)
        return self.apply_token_bitmask(logits, bitmask, masked_rows_t)  # [P, V]
