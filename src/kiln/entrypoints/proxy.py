"""``kiln proxy``: an OpenAI-compatible front for disaggregated prefill (vLLM's protocol).

For each ``/v1/completions`` or ``/v1/chat/completions`` request the proxy:

1. sends the request to the next prefill instance (round robin) with ``max_tokens=1``, no
   streaming and ``kv_transfer_params={"do_remote_decode": true}``; that instance (a
   ``P2pConnector`` ``kv_producer``) computes the prompt, keeps its KV blocks and answers with
   ``kv_transfer_params`` saying where they wait;
2. sends the original request plus those ``kv_transfer_params`` to the next decode instance
   (a ``kv_consumer``), which pulls the blocks instead of computing the prompt, and returns its
   answer (streamed or not) to the client as it comes.

``/v1/models`` comes from a decode instance, ``/health`` is 200 only while every instance
answers its own. An instance that cannot be reached gives a 502 with an OpenAI error body (503
from ``/health``), within ``--connect-timeout`` seconds; one that hangs, within ``--timeout``.
A prefill instance's error answer (a 400 for a bad request, say) goes back to the client as it is.

The proxy knows HTTP and JSON only: no model, no tokenizer, no engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.entrypoints.openai.errors import OpenAIError, error_body, sse_error

ROUTES = ("/v1/completions", "/v1/chat/completions")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill instances (kiln serve with a P2pConnector kv_producer), e.g. "
        "http://127.0.0.1:8100",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode instances (kiln serve with a P2pConnector kv_consumer)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to reach an instance before answering 502 (default 5)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds an instance may take between two bytes of its answer (default 600)",
    )


def _error(message: str, status_code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code)


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets: one completion of one token, not streamed, its KV
    kept."""
    prefill = {**body, "max_tokens": 1, "stream": False, "n": 1}
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


class Proxy:
    """The proxy's state: the instances, round-robin cursors and one HTTP client."""

    def __init__(
        self, prefill: list[str], decode: list[str], connect_timeout: float, timeout: float
    ) -> None:
        self.prefill = [url.rstrip("/") for url in prefill]
        self.decode = [url.rstrip("/") for url in decode]
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout), trust_env=False
        )

    async def forward(self, route: str, raw: Request) -> Response:
        """One completion request through a prefill instance, then a decode instance."""
        try:
            body = json.loads(await raw.body())
        except ValueError as exc:
            return _error(f"the body is not valid JSON: {exc}", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        url = next(self._next_prefill)
        try:
            prefilled = await self.client.post(url + route, json=_prefill_body(body))
        except httpx.HTTPError as exc:
            return _error(f"prefill instance {url} failed: {type(exc).__name__}: {exc}", 502)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        params = prefilled.json().get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": params} if params else body
        url = next(self._next_decode)
        if body.get("stream"):
            return await self._stream(url + route, decode_body)
        try:
            decoded = await self.client.post(url + route, json=decode_body)
        except httpx.HTTPError as exc:
            return _error(f"decode instance {url} failed: {type(exc).__name__}: {exc}", 502)
        return Response(decoded.content, decoded.status_code, media_type="application/json")

    async def _stream(self, url: str, body: dict[str, Any]) -> Response:
        """The decode instance's answer streamed through; an instance lost midway ends the
        stream with an error event."""
        try:
            answer = await self.client.send(
                self.client.build_request("POST", url, json=body), stream=True
            )
        except httpx.HTTPError as exc:
            return _error(f"decode instance {url} failed: {type(exc).__name__}: {exc}", 502)
        if answer.status_code != 200:
            content = await answer.aread()
            await answer.aclose()
            return Response(content, answer.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                yield sse_error(OpenAIError(f"decode instance {url} failed: {exc}", 502))
            finally:
                await answer.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def models(self) -> Response:
        url = self.decode[0]
        try:
            answer = await self.client.get(url + "/v1/models")
        except httpx.HTTPError as exc:
            return _error(f"decode instance {url} failed: {type(exc).__name__}: {exc}", 502)
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def health(self) -> Response:
        down = []
        for url in [*self.prefill, *self.decode]:
            try:
                ok = (await self.client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(f"instances not healthy: {', '.join(down)}", 503)
        return Response(status_code=200)


def _route_handler(proxy: Proxy, route: str) -> Any:
    async def post(raw: Request) -> Response:
        return await proxy.forward(route, raw)

    return post


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="kiln proxy")
    for route in ROUTES:
        app.add_api_route(route, _route_handler(proxy, route), methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    return app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    proxy = Proxy(args.prefill, args.decode, args.connect_timeout, args.timeout)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0


__all__ = ["Proxy", "add_cli_args", "build_app", "main"]
