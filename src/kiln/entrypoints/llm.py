"""The offline front end: ``LLM(model).generate(prompts, params)`` and ``.chat(messages)``;
with ``runner="pooling"``, ``.embed(prompts)`` and ``.encode(prompts)`` (vLLM's names).

The engine core runs in this process. ``model=None`` serves the embedded default model
(SmolLM2-135M-Instruct). Keyword arguments are ``kiln serve``'s flags with underscores
(``max_num_seqs=16``, ``kv_cache_memory=2``...); an unknown one is a ``ValueError``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

from tqdm import tqdm

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.frontend import pooling_sampling_params
from kiln.engine.input_processor import PromptType
from kiln.engine.llm_engine import LLMEngine
from kiln.lora.request import LoRARequest
from kiln.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from kiln.plugins import init_process
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import RequestOutputKind, SamplingParams
from kiln.tokenizer import Tokenizer

Messages = Sequence[Mapping[str, Any]]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """``prompts`` as a list: one prompt (a string, a mapping, or token ids) becomes a list of
    one."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [cast("Sequence[int]", prompts)]  # token ids: one prompt
    # What is left is a sequence of prompts (isinstance cannot tell Sequence[int] from it).
    return list(cast("Sequence[PromptType]", prompts))


class LLM:
    def __init__(self, model: str | None = None, *, log_stats: bool = False, **kwargs: Any):
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        config = init_process("offline", args.create_config())
        self.llm_engine = LLMEngine(config, log_stats=log_stats)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.frontend.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of ``prompts``.

        Args:
            prompts: a string, token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar.
            priority: per prompt; lower runs first.
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base
                model); needs ``enable_lora=True``.

        Raises:
            ValueError: an invalid prompt or params (nothing is queued then).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
            )
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role", "content"}``) or to several.

        Args:
            tools: OpenAI-style tool definitions (``{"type": "function", "function": {...}}``),
                given to the chat template as ``tools``. Assistant messages may carry
                ``tool_calls`` and no content (their JSON-text ``arguments`` reach the template as
                objects) and ``tool`` messages a ``tool_call_id``. The output is the model's text:
                parse its calls with a tool parser (``kiln.entrypoints.openai.tool_parsers``).

        Raises:
            ValueError: a message in a shape no template takes (naming the field: arguments that
                are not JSON of an object, a content part that is not text), the template
                rejects the messages, or ``tools`` is set in
                ``chat_template_kwargs`` as well.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        template_kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            if "tools" in template_kwargs:
                raise ValueError("give tools either as `tools` or in chat_template_kwargs")
            template_kwargs["tools"] = [dict(tool) for tool in tools]
        frontend = self.llm_engine.frontend
        prompts = [
            frontend.render_chat(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (``outputs.embedding``, a list of floats), in order;
        needs ``runner="pooling"``. The pooling type and default normalisation are the
        ``pooler_config``'s; ``pooling_params`` (one for all, or one per prompt) may set
        ``dimensions`` and ``normalize``.

        Raises:
            ValueError: an invalid prompt or params, or an engine that is not a pooling one.
        """
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm)
        return [
            EmbeddingRequestOutput(
                output.request_id,
                EmbeddingOutput(cast("PoolingOutput", output.outputs).data.tolist()),
                output.prompt_token_ids,
                num_cached_tokens=output.num_cached_tokens,
            )
            for output in outputs
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """As ``embed``, with each vector as a float32 tensor (``outputs.data``)."""
        import numpy as np
        import torch

        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            pooling_list = list(pooling_params)
        if len(pooling_list) != len(prompts):
            raise ValueError(
                f"pooling_params has {len(pooling_list)} entries for {len(prompts)} prompts"
            )
        params_list = [pooling_sampling_params()] * len(prompts)
        outputs = self._run(prompts, params_list, use_tqdm, None, pooling=pooling_list)
        return [
            PoolingRequestOutput(
                output.request_id,
                PoolingOutput(
                    torch.from_numpy(np.frombuffer(output.pooled or b"", dtype="<f4").copy())
                ),
                output.prompt_token_ids,
                num_cached_tokens=output.num_cached_tokens,
            )
            for output in outputs
        ]

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None,
        loras: Sequence[LoRARequest | None] | None = None,
        pooling: Sequence[PoolingParams] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                if params.output_kind != RequestOutputKind.FINAL_ONLY:
                    params = params.clone()
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                    pooling_params=pooling[i] if pooling else None,
                )
                request_ids.append(request_id)
        except ValueError:
            engine.abort_request(request_ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
