"""What every front end (offline ``LLM``, ``AsyncLLM``) does around the engine core: load the
tokenizer, render chat, validate and tokenize prompts, fan ``n > 1`` out into child requests, and
turn engine-core outputs back into ``RequestOutput``s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.config import KilnConfig
from kiln.engine.input_processor import InputProcessor, PromptType, fan_out, prompt_text
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request_state import ParentRequest
from kiln.lora.peft import AdapterChecker
from kiln.lora.request import LoRARequest
from kiln.messages import EngineCoreRequest
from kiln.model_executor.loader import get_loader, resolve_model_ref
from kiln.model_executor.loader.default_model import DEFAULT_MODEL_NAME
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import RequestOutputKind, SamplingParams
from kiln.tokenizer import Tokenizer, load_tokenizer

_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "chat_template"}
)


def served_model_name(config: KilnConfig) -> str:
    """The name clients use: ``--served-model-name``, else the model's own name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if not config.model.model:
        return DEFAULT_MODEL_NAME
    return config.model.model.rstrip("/")


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a Jinja file, or the template text itself."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def pooling_sampling_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The sampling params a pooling request carries through the engine: it never samples, and
    its one output is its last; ``truncate_prompt_tokens`` keeps the prompt's last tokens.

    Raises:
        ValueError: ``truncate_prompt_tokens`` is neither None, -1 nor positive.
    """
    return SamplingParams(
        max_tokens=1,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        truncate_prompt_tokens=truncate_prompt_tokens,
    )


class Frontend:
    """Tokenizer, input processor and output processor for one model.

    Args:
        config: the platform-updated config.
        max_model_len: the context length the engine core settled on.
    """

    def __init__(self, config: KilnConfig, max_model_len: int) -> None:
        model_ref = resolve_model_ref(config.model.model)
        loader = get_loader(model_ref, config.model.load_format)
        hf_config = loader.load_hf_config(model_ref)
        self.model_name = served_model_name(config)
        self.max_model_len = max_model_len
        self.tokenizer: Tokenizer = load_tokenizer(
            config.model.tokenizer or loader.tokenizer_source(model_ref)
        )
        self.chat_template = read_chat_template(config.model.chat_template)
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len,
            config.model.max_logprobs,
            self.tokenizer.eos_token_id,
            vocab_size=int(hf_config.get("vocab_size") or self.tokenizer.vocab_size),
            structured_outputs_backend=config.structured_outputs.backend,
            scheduling_policy=config.scheduler.policy,
            runner=config.model.runner,
            hidden_size=hf_config.get("hidden_size"),
            lora_checker=(
                AdapterChecker(config.lora.max_lora_rank, hf_config)
                if config.lora.enable_lora
                else None
            ),
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def make_requests(
        self,
        request_id: str,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate ``prompt``, register it with the output processor, and return the engine-core
        requests to send (one per completion when ``n > 1``). An ``EngineCoreRequest`` is one
        that ``input_processor.process`` made already (under ``request_id``): it is used as it
        is, with its own params and priority.

        Raises:
            ValueError: an invalid prompt or params (see ``InputProcessor.process``).
        """
        if isinstance(prompt, EngineCoreRequest):
            request, text = prompt, None
        else:
            request = self.input_processor.process(
                request_id,
                prompt,
                params,
                arrival_time,
                priority,
                lora_request=lora_request,
                pooling_params=pooling_params,
            )
            text = prompt_text(prompt)
        children = fan_out(request)
        n = request.sampling_params.n
        parent = ParentRequest(request_id, request.sampling_params) if n > 1 else None
        for index, child in enumerate(children):
            self.output_processor.add_request(child, text, parent, index)
        return children

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation, rendered with the model's (or the given) template.

        Raises:
            ValueError: the model has no chat template and none was given, the template failed,
                or ``chat_template_kwargs`` names a variable set here.
        """
        reserved = sorted(_RESERVED_TEMPLATE_VARIABLES.intersection(chat_template_kwargs or {}))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs must not set {reserved}: pass them as arguments"
            )
        return self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template or self.chat_template,
            **dict(chat_template_kwargs or {}),
        )
