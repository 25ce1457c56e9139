"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), and its bounds.

Contract: as every body in ``protocol``, unknown fields are accepted (and logged once), ``null``
means the default, and only types and simple ranges are checked here. ``input`` items and
``tools`` are kept as plain objects: ``serving_responses`` checks each one and turns them into
chat messages and chat tools, so that each error names the item at fault (``input[2].role``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.entrypoints.openai.protocol import Int, RequestBody

MAX_INPUT_ITEMS = 2048
"""The most ``input`` items one request may send (with the stored conversation it continues)."""
MAX_METADATA_PAIRS = 16
"""OpenAI's bounds on ``metadata``: 16 pairs, keys of up to 64 characters, values of 512."""
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RESPONSE_ID_CHARS = 128


class ResponsesRequest(RequestBody):
    """``POST /v1/responses``: OpenAI's fields that Kiln serves; any other is ignored (logged)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    """A user message as text, or a list of items: messages (``{"role", "content"}``, with or
    without ``"type": "message"``), ``function_call``, ``function_call_output`` and ``reasoning``
    items (the last are dropped: the template gets no earlier thinking)."""
    instructions: str | None = None
    """A system turn before the input (not carried over by ``previous_response_id``)."""
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    """Function tools in the Responses shape: ``{"type": "function", "name", "description",
    "parameters", "strict"}``."""
    tool_choice: str | dict[str, Any] | None = None
    """``none``, ``auto``, ``required`` or ``{"type": "function", "name": ...}``."""
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""
    reasoning: dict[str, Any] | None = None
    """``{"effort", "summary"}``: accepted and echoed; thinking is the model's and the
    ``--reasoning-parser``'s business."""
    stream: bool = False
    store: bool = True
    """Keep the response (``GET /v1/responses/{id}``, ``previous_response_id``)."""
    previous_response_id: str | None = Field(default=None, max_length=MAX_RESPONSE_ID_CHARS)
    background: bool = False
    """Refused when true: responses run while their request is open."""
    truncation: Literal["disabled", "auto"] | None = None
    """``auto`` is refused: a conversation too long for the context is a 400."""
    include: list[str] | None = None
    top_logprobs: Int | None = None
    """Refused above 0 (logprobs are a chat-completions feature here)."""
    # vLLM extras
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constraint on the output (as on chat completions: ``regex``, ``choice``, ``json``,
    ``grammar``, ``json_object``, and the JSON options beside ``text.format``)."""


__all__ = [
    "MAX_INPUT_ITEMS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "ResponsesRequest",
]
