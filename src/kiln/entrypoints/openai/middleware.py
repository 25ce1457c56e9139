"""The server's ASGI middleware: the API-key check, the request-body bound, and the last-resort
500 that keeps a connection usable. ``api_server.build_app`` installs them."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.entrypoints.openai.errors import OpenAIError, error_response, internal_error

_GUARDED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/pooling", "/score"})


def _is_guarded(path: str) -> bool:
    return path in _GUARDED_PATHS or path.startswith("/v1/")


class APIKeyMiddleware:
    """Answers 401 to a request for a guarded route (``/v1/*``, ``/tokenize``, ``/detokenize``,
    ``/pooling``, ``/score``)
    without ``Authorization: Bearer <one of the keys>``."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_guarded(scope.get("path", "")):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not any(hmac.compare_digest(given, key) for key in self.expected):
                error = OpenAIError(
                    "Unauthorized: send a valid API key as `Authorization: Bearer <key>`.", 401
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request body over ``max_bytes`` with 413: at once when its ``Content-Length``
    says so, else (a chunked body) as soon as more than that has arrived."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes).",
            413,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    # An HTTPException passes FastAPI's body parsing unchanged (see errors).
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited_receive, send)


class InternalErrorMiddleware:
    """Answers an unexpected exception with a 500 OpenAI error body and keeps the connection
    usable: Starlette's last-resort handler re-raises after answering, and uvicorn then drops the
    keep-alive connection without ``Connection: close``. After the response has started there is
    nothing to answer: the exception goes on (uvicorn closes the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            error = internal_error(exc, str(scope.get("path")))
            await error_response(error)(scope, receive, send)


__all__ = ["APIKeyMiddleware", "BodyLimitMiddleware", "InternalErrorMiddleware"]
