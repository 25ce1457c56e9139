"""Request bodies of the OpenAI-compatible routes: pydantic models with OpenAI's and vLLM's names.

Contract: every model accepts unknown fields (``extra="allow"``: benchmark clients send fields we
do not use; the server logs them once) and checks only types and simple ranges here. ``null``
means "the default" for every field (the OpenAI SDK sends it for unset fields). Every integer
fits a signed 64-bit int, every float is finite, and no string holds a lone surrogate (none of
these survive tokenizing or the engine's wire encoding). What depends
on the model or the server (context length, vocabulary, ``max_logprobs``) is checked by the
serving classes, and sampling ranges by ``SamplingParams``. A type error becomes an HTTP 400 with
an OpenAI error body (see ``errors``), never FastAPI's 422.

Responses are plain dicts built by the serving modules (so that which keys are present, and which
are null, is exactly OpenAI's); their shapes are documented there.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from kiln.kv_transfer.params import check_kv_transfer_params
from kiln.sampling_params import StructuredOutputsParams
from kiln.tokenizer import message_text, tool_call_arguments

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

Int = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
"""An integer the engine's wire encoding can carry."""


def _find_lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in ``value`` with a lone UTF-16 surrogate."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, where))
                stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # The OpenAI SDK sends null for fields it leaves unset (n, echo...): use the default.
        if isinstance(data, dict) and None in data.values():
            return {
                key: value
                for key, value in data.items()
                if value is not None or key not in cls.model_fields
            }
        return data

    def unknown_fields(self) -> list[str]:
        """Fields the client sent that this model does not declare."""
        return sorted(self.model_extra or {})


class RequestBody(OpenAIBaseModel):
    """A route's whole request body: refuses lone surrogates anywhere in it."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _find_lone_surrogate(data, "")
        if where is not None:
            raise ValueError(
                f"{where or 'the body'} holds a lone UTF-16 surrogate (such as \\ud800), which "
                "is not valid Unicode text"
            )
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    """One last chunk with ``usage`` and ``choices: []`` before ``[DONE]``."""
    continuous_usage_stats: bool | None = False
    """``usage`` (so far) in every chunk (vLLM)."""


class _SamplingFields(RequestBody):
    """Fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: Int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int = 0
    allowed_token_ids: list[Int] | None = None
    """Only these token ids may be sampled (vLLM)."""
    bad_words: list[str] | None = None
    """Words never generated (vLLM)."""
    truncate_prompt_tokens: Int | None = None
    """Keep only the prompt's last ``k`` tokens; -1: the last ``max_model_len`` (vLLM)."""
    request_id: str | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constraint on the output: one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (EBNF) or ``json_object`` (the ``StructuredOutputsParams`` fields)."""
    kv_transfer_params: dict[str, Any] | None = None
    """What the KV connector is asked (vLLM's disaggregated prefill: ``{"do_remote_decode":
    true}`` on a prefill instance; the prefill's answer with ``"do_remote_prefill": true`` on a
    decode instance); checked by ``kiln.kv_transfer.params``."""

    @field_validator("kv_transfer_params", mode="before")
    @classmethod
    def _check_kv_transfer_params(cls, value: Any) -> Any:
        return check_kv_transfer_params(value)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint.

        Raises:
            ValueError: an invalid ``structured_outputs`` (names the field).
        """
        if self.structured_outputs is None:
            return None
        fields = StructuredOutputsParams.__dataclass_fields__
        unknown = sorted(set(self.structured_outputs) - set(fields))
        if unknown:
            raise ValueError(f"structured_outputs keys must be in {sorted(fields)}, got {unknown}")
        return StructuredOutputsParams(**self.structured_outputs)

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


TokenIds = list[StrictInt]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds] | None = None
    """Text, texts, token ids (used exactly as given: no BOS is added) or lists of token ids."""
    max_tokens: Int | None = 16
    """Tokens to generate; null means 16. 0 is allowed only with ``echo`` (prompt only)."""
    logprobs: Int | None = None
    """Top logprobs per token (the sampled token's is always included)."""
    echo: bool = False
    """Prepend the prompt to the text (and, with ``logprobs``, its logprobs; the first is null)."""
    suffix: str | None = None
    best_of: Int | None = None
    # vLLM extras
    add_special_tokens: bool = True
    """Tokenize a text prompt with the model's BOS policy."""
    prompt_logprobs: Int | None = None
    """Logprobs of each prompt token, in the choice's ``prompt_logprobs`` (vLLM)."""
    return_token_ids: bool = False
    """Add ``prompt_token_ids`` and ``token_ids`` to each choice (vLLM)."""


MAX_TOOL_NAME_CHARS = 256
"""The longest function name a tool or a call may have."""
MAX_TOOL_CALL_ARGUMENTS_CHARS = 2**17
"""The longest ``arguments`` text of a call in a message."""


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); none: the function takes no arguments."""
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(OpenAIBaseModel):
    name: str = Field(max_length=MAX_TOOL_NAME_CHARS)
    arguments: str | dict[str, Any] = Field(default="{}")
    """JSON text of an object (OpenAI's form; empty: no arguments) or an object. Kept as the
    object, as vLLM gives it to chat templates (which write it with ``tojson`` or iterate it);
    text that is not JSON of an object is refused."""

    @field_validator("arguments")
    @classmethod
    def _parse_arguments(cls, arguments: Any) -> dict[str, Any]:
        if isinstance(arguments, str) and len(arguments) > MAX_TOOL_CALL_ARGUMENTS_CHARS:
            raise ValueError(
                f"arguments must hold at most {MAX_TOOL_CALL_ARGUMENTS_CHARS} characters, "
                f"got {len(arguments)}"
            )
        return tool_call_arguments(arguments)


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message's ``tool_calls``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    """Text, a list of ``{"type": "text", "text": ...}`` parts (the only kind supported; kept
    joined with newlines), or null (with ``tool_calls``; the template gets ``""``)."""
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """An assistant message's calls (passed to the chat template)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    @field_validator("content")
    @classmethod
    def _join_parts(cls, content: Any) -> Any:
        return message_text(content) if isinstance(content, list) else content


JSON_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
"""``structured_outputs`` keys that shape a JSON grammar without being one."""


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    """``{"name": ..., "schema": {...}, "strict": bool}`` for ``json_schema``."""

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint this format asks for (None for ``text``); enforced while sampling.

        Raises:
            ValueError: ``json_schema`` without an object ``schema`` (names the field).
        """
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "text":
            return None
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError(
                "response_format.json_schema.schema must be a JSON schema (an object), got "
                f"{schema!r}"
            )
        return StructuredOutputsParams(json=schema)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    max_tokens: Int | None = None
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; neither: the rest of the
    context."""
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatCompletionToolParam] | None = None
    """Functions the model may call (also passed to the chat template)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: ``auto`` with tools, ``none`` without. ``auto`` needs the server's
    ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""
    parallel_tool_calls: bool | None = None
    """False: at most one call."""
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    """The chat template writes its own special tokens, so none are added by default."""
    chat_template: str | None = None
    """A Jinja template to use instead of the model's: refused unless the server runs with
    ``--trust-request-chat-template``."""
    chat_template_kwargs: dict[str, Any] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` or ``response_format``; beside ``response_format``,
        ``structured_outputs`` may hold the JSON options only (``disable_any_whitespace``,
        ``disable_additional_properties``), which then apply to the format's grammar, as in vLLM.

        Raises:
            ValueError: both constrain the output, or either is invalid (names the field).
        """
        from_format = None
        if self.response_format is not None:
            from_format = self.response_format.structured_outputs_params()
        if from_format is None:
            return super().structured_outputs_params()
        options = self.structured_outputs or {}
        if set(options) - set(JSON_OPTIONS):
            raise ValueError(
                "structured_outputs and response_format must not both constrain the output; "
                f"allowed beside response_format: structured_outputs with {list(JSON_OPTIONS)} only"
            )
        return dataclasses.replace(from_format, **options)


class TokenizeRequest(RequestBody):
    """``POST /tokenize``: ``prompt`` (completion style) or ``messages`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    """Default: True for ``prompt``, False for ``messages`` (as the two routes do)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(RequestBody):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: TokenIds


__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionToolParam",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "FunctionCall",
    "FunctionDefinition",
    "NamedToolChoice",
    "OpenAIBaseModel",
    "RequestBody",
    "ResponseFormat",
    "StreamOptions",
    "TokenizeRequest",
    "ToolCallParam",
]
