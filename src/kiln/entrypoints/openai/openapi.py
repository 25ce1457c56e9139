"""The server's OpenAPI document, telling the truth about status codes.

FastAPI documents a 422 ``HTTPValidationError`` for every route with a body; Kiln answers invalid
requests with 400 and an OpenAI error body (``kiln.entrypoints.openai.errors``). ``install_openapi``
replaces that: each operation lists the statuses it can answer, each error with the
``ErrorResponse`` schema:

- every operation: 500 (a bug; the body names an error id);
- a body: 400 (invalid request) and 413 (over ``--max-request-body-bytes``);
- with ``--api-key``, the guarded routes (``/v1/*``, ``/tokenize``, ``/detokenize``,
  ``/pooling``, ``/score``): 401;
- a ``model`` field (generation, pooling and tokenizer routes) or an adapter name: 404;
- a stored response's id (``previous_response_id``, ``/v1/responses/{response_id}...``): 404;
- ``POST /v1/responses/{response_id}/cancel``: 400 (the response has finished);
  ``GET /v1/responses/{response_id}/input_items``: 400 (a bad ``limit``, ``order``, ``after``);
- generation and pooling routes: 503 (overloaded, engine not running, shutting down);
  ``/health``: 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
    }
)
"""Routes that run the model (the pooling ones too): 503 when overloaded or shutting down."""
STORED_RESPONSE_PATHS = frozenset(
    {
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}/input_items",
    }
)
NOT_FOUND_PATHS = (
    GENERATION_PATHS
    | STORED_RESPONSE_PATHS
    | {"/tokenize", "/detokenize", "/v1/unload_lora_adapter"}
)
"""Routes that answer 404: an unknown ``model``, an adapter name not loaded, or an unknown
stored response."""
_GUARDED_PATHS = ("/tokenize", "/detokenize", "/pooling", "/score")
_DESCRIPTIONS = {
    "400": "Invalid request: a field out of range, of the wrong type, or refused",
    "401": "Missing or wrong API key",
    "404": "Unknown model, adapter or stored response",
    "413": "Request body over the server's limit",
    "500": "Internal error (a bug); the body names an error id the server log has",
    "503": "Overloaded, the engine is not running, or the server is shutting down",
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}


def error_statuses(path: str, has_body: bool, api_keys: bool) -> list[str]:
    """The error statuses an operation on ``path`` can answer (see the module doc)."""
    statuses = {"500"}
    if has_body:
        statuses |= {"400", "413"}
    if path in ("/v1/responses/{response_id}/cancel", "/v1/responses/{response_id}/input_items"):
        statuses.add("400")
    if api_keys and (path.startswith("/v1/") or path in _GUARDED_PATHS):
        statuses.add("401")
    if path in NOT_FOUND_PATHS:
        statuses.add("404")
    if path in GENERATION_PATHS or path == "/health":
        statuses.add("503")
    return sorted(statuses)


def build_openapi(app: FastAPI, api_keys: bool) -> dict[str, Any]:
    """``app``'s OpenAPI document with Kiln's error statuses instead of FastAPI's 422."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, item in document.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            has_body = "requestBody" in operation
            for status in error_statuses(path, has_body, api_keys):
                body = {} if path == "/health" else {"content": error}
                responses[status] = {"description": _DESCRIPTIONS[status], **body}
    return document


def install_openapi(app: FastAPI, api_keys: bool) -> None:
    """Serve ``build_openapi``'s document at ``/openapi.json`` (built once, at first request)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cache:
            cache.update(build_openapi(app, api_keys))
        return cache

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["build_openapi", "error_statuses", "install_openapi"]
