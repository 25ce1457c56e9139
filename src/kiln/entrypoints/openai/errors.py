"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with vLLM's types.

Contract: every error the server answers has this body and the HTTP status in ``code`` (an int, as
vLLM): request validation (FastAPI's own would be 422) and ``ValueError`` s from the engine's
validation are 400 ``BadRequestError``; an unknown model is 404 ``NotFoundError``; a missing or
wrong API key 401 ``AuthenticationError``; a full queue, a dead engine or a server shutting down
503 ``ServiceUnavailableError`` (with ``Retry-After`` when retrying makes sense); anything
unexpected 500 ``InternalServerError``. Once a stream has started, the same body goes out as an
SSE event (``sse_error``), followed by ``data: [DONE]``.

No internals in a body: a 500 or a dead engine's 503 says what happened and, for a 500, an error
id; the exception, its traceback and any path go to the server log under that id
(``internal_error``), never to the client.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from kiln.engine.async_llm import QueueFullError
from kiln.messages import EngineDeadError, KVLoadFailedError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error the server answers with an OpenAI error body.

    Args:
        message: what went wrong, for the client.
        status_code: the HTTP status (400 by default).
        param: the request field at fault, if one is.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param)


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "BadRequestError" if status_code < 500 else "Error"),
            "param": param,
            "code": status_code,
        }
    }


def error_response(error: OpenAIError) -> Response:
    return Response(
        msgspec.json.encode(error.to_dict()),
        status_code=error.status_code,
        headers=error.headers,
        media_type="application/json",
    )


def sse_error(error: OpenAIError) -> bytes:
    """The SSE event that reports an error once streaming has begun."""
    return b"data: " + msgspec.json.encode(error.to_dict()) + b"\n\n"


def to_openai_error(exc: BaseException) -> OpenAIError:
    """The error answer for an exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError(
            f"The server is overloaded ({exc}); retry later.",
            503,
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, EngineDeadError):
        # Its message may hold the engine's traceback: the log has it (the client marked the
        # engine dead with the reason).
        return OpenAIError("The engine is not running; the server log has the reason.", 503)
    if isinstance(exc, KVLoadFailedError):
        return OpenAIError(f"The request failed: {exc}; retry later.", 503)
    if isinstance(exc, ValueError):
        return bad_request(exc)
    return internal_error(exc)


def internal_error(exc: BaseException, where: str = "a request") -> OpenAIError:
    """The 500 for an unexpected ``exc``: logged with its traceback under a fresh error id, which
    the body names (and nothing else of ``exc``)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s in %s", error_id, where, exc_info=exc)
    return OpenAIError(
        f"Internal server error (error id {error_id}); the server log has the details.", 500
    )


_LEADING_NAME = re.compile(r"^'?([a-z_]+)")


def bad_request(exc: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> OpenAIError:
    """A 400 from a ``ValueError`` of the engine's validation, whose messages start with the name
    of the field at fault (``"temperature must be >= 0, got -1"``): that name is the ``param`` when
    it is one of ``fields``."""
    message = str(exc)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in fields else None
    return OpenAIError(message, 400, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {error.get('ctx', {}).get('error', message)}"
            loc = []
        where = ".".join(loc)
        if param is None and where:
            param = where
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request", param


def install_exception_handlers(app: FastAPI) -> None:
    """Answer every error with an OpenAI error body (validation: 400, not FastAPI's 422)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(OpenAIError(message, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        error = OpenAIError(str(exc.detail), exc.status_code, headers=headers)
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this response is sent (InternalErrorMiddleware, when
        # installed, catches it first).
        return error_response(internal_error(exc, request.url.path))


__all__ = [
    "OpenAIError",
    "bad_request",
    "error_body",
    "error_response",
    "install_exception_handlers",
    "internal_error",
    "sse_error",
    "to_openai_error",
]
