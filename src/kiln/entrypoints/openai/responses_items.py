"""The Responses API in terms of chat completions: a ``ResponsesRequest`` becomes the
``ChatCompletionRequest`` the chat route runs (messages, tools, tool choice, response format,
sampling fields), and a chat answer becomes Responses output items.

Contract: every input item, tool and format is checked here, and a bad one is a 400 whose
``param`` names it (``input[3].content[0].type``, ``tools[1].type``, ``tool_choice``,
``text.format.type``). Chat's own checks (tool flags, named tool in ``tools``, context length)
run afterwards in the chat route; ``chat_param`` renames the fields its errors name.

Mapping (as vLLM's and OpenAI's): ``instructions`` -> a leading system turn; a message item ->
a chat message (``input_text`` / ``output_text`` parts joined); ``function_call`` items ->
``tool_calls`` of an assistant turn (consecutive calls, and calls right after an assistant
message, share that turn); ``function_call_output`` -> a ``tool`` turn; ``reasoning`` items are
dropped (templates render no earlier thinking).

What it must not know: HTTP, the engine, the store.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.protocol_responses import (
    MAX_INPUT_ITEMS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    ResponsesRequest,
)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TOOL_CHOICES = ("none", "auto", "required")
FORMAT_TYPES = ("text", "json_object", "json_schema")
_CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}


def new_id(prefix: str) -> str:
    """An id in OpenAI's shape: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_param(param: str | None) -> str | None:
    """The Responses field for a field a chat error names."""
    return _CHAT_PARAMS.get(param, param) if param is not None else None


def check_request(request: ResponsesRequest) -> None:
    """The fields Kiln refuses outright (see ``ResponsesRequest``) and the bounds.

    Raises:
        OpenAIError: 400 naming the field.
    """
    if request.background:
        raise OpenAIError(
            "background responses are not supported by this server; leave `background` out",
            param="background",
        )
    if request.truncation == "auto":
        raise OpenAIError(
            "truncation 'auto' is not supported; use 'disabled' (a conversation too long for "
            "the context is refused)",
            param="truncation",
        )
    if request.top_logprobs:
        raise OpenAIError("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if isinstance(request.input, list) and len(request.input) > MAX_INPUT_ITEMS:
        raise OpenAIError(
            f"`input` may hold at most {MAX_INPUT_ITEMS} items, got {len(request.input)}",
            param="input",
        )
    metadata = request.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise OpenAIError(
            f"`metadata` may hold at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise OpenAIError(
                f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"{MAX_METADATA_VALUE_CHARS}; {key[:MAX_METADATA_KEY_CHARS]!r} is longer",
                param="metadata",
            )


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message), each with its ``type`` and
    an ``id`` (as OpenAI lists stored input items); other values are kept as given."""
    if isinstance(request.input, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "content": request.input}]
    items = []
    for item in request.input:
        if isinstance(item, dict) and "id" not in item:
            kind = item.get("type", "message")
            item = {"type": kind, "id": new_id(_ID_PREFIXES.get(kind, "item")), **item}
        items.append(item)
    return items


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise OpenAIError(
                f"{part_where}.type must be one of {list(TEXT_PART_TYPES)}, got {kind!r} (only "
                "text input is supported)",
                param=f"{part_where}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise OpenAIError(f"{part_where}.text must be a string", param=f"{part_where}.text")
        texts.append(text)
    return "\n".join(texts)


def _string_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of ``items`` (after ``instructions`` as a system turn).

    Raises:
        OpenAIError: 400 naming the first bad item.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise OpenAIError(
                    f"{where}.role must be one of {list(MESSAGE_ROLES)}, got {role!r}",
                    param=f"{where}.role",
                )
            text = _text_content(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _string_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string_field(item, "name", where),
                    "arguments": item.get("arguments") or "{}",
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text_content(output if output is not None else "", f"{where}.output")
            call_id = _string_field(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind != "reasoning":
            raise OpenAIError(
                f"{where}.type must be one of {list(ITEM_TYPES)}, got {kind!r}",
                param=f"{where}.type",
            )
    if not messages:
        raise OpenAIError("`input` must hold at least one message", param="input")
    return messages


def to_chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape.

    Raises:
        OpenAIError: 400 naming a tool that is not a function tool, or malformed.
    """
    if tools is None:
        return None
    chat_tools = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIError(
                f"{where}.type must be 'function' (the only tool this server runs), got {kind!r}",
                param=f"{where}.type",
            )
        function = {"name": _string_field(tool, "name", where)}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def to_chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's shape.

    Raises:
        OpenAIError: 400 for a choice that is neither a mode nor a named function.
    """
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise OpenAIError(
        f"tool_choice must be one of {list(TOOL_CHOICES)} or "
        '{"type": "function", "name": "..."}, got ' + json.dumps(choice)[:200],
        param="tool_choice",
    )


def to_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``.

    Raises:
        OpenAIError: 400 naming ``text.format`` (or its ``type`` / ``schema``).
    """
    if text is None or text.get("format") is None:
        return None
    form = text["format"]
    kind = form.get("type") if isinstance(form, dict) else None
    if kind not in FORMAT_TYPES:
        raise OpenAIError(
            f"text.format.type must be one of {list(FORMAT_TYPES)}, got {kind!r}",
            param="text.format.type",
        )
    if kind != "json_schema":
        return {"type": kind}
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise OpenAIError(
            "text.format.schema must be a JSON schema (an object)", param="text.format.schema"
        )
    json_schema = {"name": form.get("name") or "response", "schema": schema}
    if form.get("strict") is not None:
        json_schema["strict"] = form["strict"]
    return {"type": "json_schema", "json_schema": json_schema}


def to_chat_request(
    request: ResponsesRequest, messages: list[dict[str, Any]], stream: bool
) -> ChatCompletionRequest:
    """The chat request that answers ``request`` for the conversation ``messages``.

    Raises:
        OpenAIError: 400 naming the Responses field at fault.
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "user": request.user,
        "tools": to_chat_tools(request.tools),
        "tool_choice": to_chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": to_response_format(request.text),
        "structured_outputs": request.structured_outputs,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error.get("loc", ())]
        param = chat_param(loc[0]) if loc else None
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        raise OpenAIError(f"{'.'.join(loc)}: {message}", param=param) from None


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def function_call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat answer's ``message`` (content, ``tool_calls``, ``reasoning_content``) as output
    items: reasoning, then the text (when there is any, or nothing else), then the calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content or not calls:
        items.append(message_item(content, status))
    for call in calls:
        function = call["function"]
        items.append(
            function_call_item(call["id"], function["name"], function["arguments"], status)
        )
    return items


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's ``status`` and ``incomplete_details`` for the chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def usage_of(chat_usage: dict[str, int], num_cached_tokens: int) -> dict[str, Any]:
    """Responses' ``usage`` from chat's and the prompt tokens the prefix cache held."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def echo_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> Any:
    if choice is None:
        return "auto" if has_tools else "none"
    return choice


__all__ = [
    "check_request",
    "chat_param",
    "input_items",
    "new_id",
    "output_items",
    "status_of",
    "to_chat_request",
    "to_messages",
    "usage_of",
]
