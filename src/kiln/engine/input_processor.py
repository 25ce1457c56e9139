"""The front end's input side: a prompt and its sampling params -> a checked ``EngineCoreRequest``.

Contract: ``InputProcessor.process`` tokenizes a text prompt with the model's BOS policy (a
token-id prompt is used exactly as given: no BOS is added), checks the request against the model
and the server (prompt not empty, token ids in the vocabulary, prompt plus ``max_tokens`` within
``max_model_len``, logprobs within ``max_logprobs``) and returns the request the engine core runs,
with its own copy of the params completed: ``max_tokens`` filled in when None, the model's EOS ids
recorded. Every rejection is a ``ValueError`` naming the field; the prompt's own faults (length,
token ids) are ``PromptError``s with the field in ``param`` and vLLM's wording, which the API
server answers unchanged as its 400. These are the only copies of the length and token-id rules.
The caller's params are never mutated. ``fan_out`` splits an ``n > 1`` request into its ``n``
child requests.

What it must not know: scheduling, the engine core's internals, how outputs are made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from kiln.lora.request import LoRARequest
from kiln.messages import EngineCoreRequest
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams
from kiln.structured_output import validate_structured_outputs

PromptType = str | Sequence[int] | Mapping[str, Any]
"""A text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (vLLM's
``TextPrompt`` / ``TokensPrompt``; with both keys the ids are used and the text is for display)."""

_SEED_RANGE = 2**64


def child_request_id(parent_request_id: str, index: int) -> str:
    """The id of child ``index`` of an ``n > 1`` request (vLLM's ``f"{index}_{parent_id}"``)."""
    return f"{index}_{parent_request_id}"


def make_child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of child ``index``: ``n = 1``, and ``seed + index`` when a seed is set, so that
    seeded children differ from each other yet are reproducible (as vLLM). Only child 0 asks
    for prompt logprobs: the prompt is the same for all, so they are computed once."""
    child = params.clone()
    child.n = 1
    if index > 0:
        child.prompt_logprobs = None
    if params.seed is not None:
        seed = params.seed + index
        child.seed = seed - _SEED_RANGE if seed >= _SEED_RANGE else seed
    return child


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine-core requests of ``request``: itself when ``n == 1``, else its ``n`` children
    (ids from ``child_request_id``, params from ``make_child_params``), in index order."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    return [
        msgspec.structs.replace(
            request,
            request_id=child_request_id(request.request_id, index),
            sampling_params=make_child_params(params, index),
        )
        for index in range(params.n)
    ]


def prompt_text(prompt: PromptType) -> str | None:
    """The text of a prompt, for ``RequestOutput.prompt`` (None for a token-id prompt)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
"""The refusal of an empty prompt (no text, no token ids, or a text that tokenizes to nothing),
in vLLM's wording, which API clients see in the 400."""


class PromptError(ValueError):
    """A prompt the engine refuses; ``param`` is the request field at fault (``"prompt"`` or
    ``"max_tokens"``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class InputProcessor:
    """Validates requests and turns prompts into token ids.

    Args:
        tokenizer: a Kiln ``Tokenizer``; None when the engine takes token ids only (then a text
            prompt is rejected).
        max_model_len: the context length: prompt plus completion tokens.
        max_logprobs: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for.
        eos_token_id: the model's EOS id (the engine core stops on it unless ``ignore_eos``).
        generation_config: the model's generation config (``eos_token_id`` may list extra ids
            that end generation); the tokenizer's extra EOS ids are added to it.
        vocab_size: number of valid token ids; default: the tokenizer's.
        structured_outputs_backend: ``structured_outputs.backend``: the grammar engine that must
            read a request's ``structured_outputs`` (checked here, before the engine sees it).
        lora_checker: checks a request's ``LoRARequest`` (``kiln.lora.peft.AdapterChecker``:
            LoRA enabled, the adapter fits the model); None refuses every adapter.
        scheduling_policy: ``scheduler.policy``; under ``fcfs`` a ``priority`` other than 0 is
            refused (as vLLM does), so no client jumps the queue unless the operator allows it.
        runner: ``model.runner``: a ``pooling`` engine takes pooling requests only (a
            ``pooling_params``), a ``generate`` engine none.
        hidden_size: the model's hidden size, the largest ``PoolingParams.dimensions``.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        max_logprobs: int,
        eos_token_id: int | None,
        generation_config: Mapping[str, Any] | None = None,
        *,
        vocab_size: int | None = None,
        structured_outputs_backend: str = "auto",
        lora_checker: Callable[[LoRARequest], None] | None = None,
        scheduling_policy: str = "fcfs",
        runner: str = "generate",
        hidden_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.runner = runner
        self.hidden_size = hidden_size
        self.scheduling_policy = scheduling_policy
        self.lora_checker = lora_checker
        self.structured_outputs_backend = structured_outputs_backend
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_id = eos_token_id
        if vocab_size is None and tokenizer is not None:
            vocab_size = tokenizer.vocab_size
        self.vocab_size = vocab_size
        self.generation_config = self._merge_eos_ids(dict(generation_config or {}), tokenizer)

    @staticmethod
    def _merge_eos_ids(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
        extra = getattr(tokenizer, "eos_token_ids", None)
        if not extra:
            return config
        eos = config.get("eos_token_id")
        eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        config["eos_token_id"] = sorted(eos_ids.union(extra))
        return config

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        prompt_name: str = "prompt",
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> EngineCoreRequest:
        """The engine-core request for ``prompt`` (see the module docstring).

        ``arrival_time`` defaults to now (``time.time()``, the clock the output processor uses).
        ``prompt_name`` is how error messages name the prompt (``"prompt 2"`` in a batch).

        Raises:
            PromptError: the prompt is empty (``EMPTY_PROMPT``), has token ids outside the
                vocabulary, or does not fit ``max_model_len`` (with ``max_tokens`` when set).
            ValueError: the prompt is of the wrong type; a ``priority`` other than 0 under the
                ``fcfs`` policy; the params ask for more
                logprobs than ``max_logprobs`` or name token ids outside the vocabulary; their
                ``structured_outputs`` spec is one the grammar engine cannot read; a
                ``lora_request`` the engine cannot serve (``check_lora``); a pooling request
                to a generate engine or a generation request to a pooling one; ``dimensions``
                above the model's hidden size.
        """
        self.check_runner(pooling_params)
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs priority scheduling; allowed: 0 under the "
                f"{self.scheduling_policy!r} policy (scheduler.policy 'priority', "
                "--scheduling-policy priority, honours priorities)"
            )
        if lora_request is not None:
            self.check_lora(lora_request)
        prompt_token_ids = self._tokenize(prompt, prompt_name)
        params = params.clone()
        prompt_token_ids = self._truncate(prompt_token_ids, params.truncate_prompt_tokens)
        self._check_length(len(prompt_token_ids), params.max_tokens)
        self._validate_params(params, len(prompt_token_ids))
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=None if params.ignore_eos else self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            lora_request=lora_request,
            pooling_params=None if pooling_params is None else pooling_params.clone(),
        )

    def check_runner(self, pooling_params: PoolingParams | None) -> None:
        """Raises ``ValueError`` unless the request fits the engine's runner: pooling requests
        (with ``pooling_params``) on ``--runner pooling`` only, with ``dimensions`` within the
        hidden size, and generation requests on ``--runner generate`` only."""
        if pooling_params is None and self.runner == "pooling":
            raise ValueError(
                "this model is served with --runner pooling: it answers embeddings "
                "(/v1/embeddings, /pooling, /score) and generates nothing; serve it with "
                "--runner generate (the default) for completions and chat"
            )
        if pooling_params is not None and self.runner != "pooling":
            raise ValueError(
                "embeddings need the pooling runner: serve the model with --runner pooling "
                f"(this engine runs --runner {self.runner})"
            )
        dimensions = None if pooling_params is None else pooling_params.dimensions
        if dimensions is not None and self.hidden_size and dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions={dimensions} is invalid; allowed: 1 to the model's hidden size "
                f"{self.hidden_size}"
            )

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raises ``ValueError`` unless LoRA is on and the adapter fits the model (its folder
        is read once per adapter)."""
        if self.lora_checker is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} needs LoRA enabled; allowed: no adapter "
                "without lora.enable_lora (--enable-lora)"
            )
        self.lora_checker(lora_request)

    def _tokenize(self, prompt: PromptType, name: str) -> list[int]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self._tokenize(prompt["prompt_token_ids"], name)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"], name)
            raise ValueError(
                f"prompt must have a 'prompt' or a 'prompt_token_ids' key, got keys {list(prompt)}"
            )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids: this engine has no tokenizer")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise PromptError(EMPTY_PROMPT, "prompt")
            return token_ids
        if not isinstance(prompt, Sequence):
            kind = type(prompt).__name__
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {kind}")
        token_ids = list(prompt)
        if not token_ids:
            raise PromptError(EMPTY_PROMPT, "prompt")
        self.check_token_ids(token_ids, name)
        return token_ids

    def check_token_ids(self, token_ids: Sequence[int], where: str = "prompt") -> None:
        """Raises ``PromptError`` (param ``"prompt"``) for the first of ``token_ids`` that is no
        token id of the vocabulary; ``where`` names the list in the message."""
        for position, token_id in enumerate(token_ids):
            at = f"token id {token_id!r} at position {position} of {where}"
            if not _is_token_id(token_id):
                raise PromptError(f"{at} must be an integer", "prompt")
            if token_id < 0:
                raise PromptError(f"{at} must be greater than or equal to 0", "prompt")
            if not self._in_vocab(token_id):
                raise PromptError(
                    f"{at} is out of vocabulary (vocab_size={self.vocab_size})", "prompt"
                )

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        # A completion has at least one token, so a prompt that fills the context cannot run.
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens. Please reduce the length of the input "
                "messages.",
                "prompt",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise PromptError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{num_prompt_tokens} input tokens ({max_tokens} > {limit} - "
                f"{num_prompt_tokens}).",
                "max_tokens",
            )

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last ``keep`` of ``token_ids`` (-1: the last ``max_model_len``; None: all)."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:] if len(token_ids) > keep else token_ids

    def _in_vocab(self, token_id: int) -> bool:
        return token_id >= 0 and (self.vocab_size is None or token_id < self.vocab_size)

    def _validate_params(self, params: SamplingParams, prompt_len: int) -> None:
        params.verify_max_logprobs(self.max_logprobs)
        for token_id in params.stop_token_ids or []:
            if not self._in_vocab(token_id):
                raise ValueError(
                    f"stop_token_ids must be token ids in [0, {self.vocab_size}), got {token_id}"
                )
        for token_id in params.logit_bias or {}:
            if not self._in_vocab(token_id):
                raise ValueError(
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {token_id}"
                )
        for token_id in params.allowed_token_ids or []:
            if not self._in_vocab(token_id):
                raise ValueError(
                    f"allowed_token_ids must be token ids in [0, {self.vocab_size}), got {token_id}"
                )
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(
                    "bad_words need a tokenizer; allowed: none when the engine takes token ids "
                    "only (skip_tokenizer_init)"
                )
            params.update_from_tokenizer(
                lambda text: self.tokenizer.encode(text, add_special_tokens=False)
            )
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs, self.structured_outputs_backend)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - prompt_len


__all__ = [
    "InputProcessor",
    "PromptError",
    "PromptType",
    "child_request_id",
    "fan_out",
    "make_child_params",
    "prompt_text",
]
