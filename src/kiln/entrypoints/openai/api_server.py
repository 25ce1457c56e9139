"""The OpenAI-compatible HTTP server: FastAPI routes, API-key check, and the process lifecycle.

Lifecycle (``run_server``): run the plugin lifecycle for the API process, bind the port (not yet
listening, so it stays closed while the model loads), start the engine core in its own process,
print the banner, then serve with uvicorn. On SIGTERM or SIGINT: stop accepting connections,
answer new requests 503, let in-flight requests finish for up to ``--shutdown-timeout`` seconds,
abort the rest (their responses end with finish_reason ``"abort"``), stop the engine process and
exit 0. A second signal skips the wait. If the engine core dies, the requests in flight are
answered (with errors), then the server exits with status 1, so a supervisor restarts it.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``/v1/responses`` (see
``serving_responses``), ``GET /v1/models``, ``GET
/health`` (200, or 503 when an engine is dead or stalled, or the server is shutting down), ``GET
/metrics`` (and ``HEAD``), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET
/debug/plugins``; the pooling routes ``POST /v1/embeddings``, ``/pooling`` and ``/score``
(``serving_pooling``; a 400 unless the server runs ``--runner pooling``).
With ``--api-key``, ``/v1/*``, ``/tokenize``, ``/detokenize``, ``/pooling`` and ``/score`` need
the key (the routes that run the tokenizer, a template or the model). A request body over
``--max-request-body-bytes`` is refused with 413 before it is read whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response

import kiln
from kiln.config import KilnConfig
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.chat_tools import ToolServerOptions, resolve_server_options
from kiln.entrypoints.openai.errors import OpenAIError, install_exception_handlers
from kiln.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kiln.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    InternalErrorMiddleware,
)
from kiln.entrypoints.openai.openapi import install_openapi
from kiln.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kiln.entrypoints.openai.responses_store import ResponseStore
from kiln.entrypoints.openai.server_state import ServerOptions, ServerState
from kiln.entrypoints.openai.serving_chat import OpenAIServingChat
from kiln.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kiln.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    OpenAIServingModels,
    OpenAIServingTokenization,
    UnloadLoRAAdapterRequest,
    parse_lora_modules,
)
from kiln.entrypoints.openai.serving_pooling import register_pooling_routes
from kiln.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from kiln.messages import EngineDeadError
from kiln.model_executor.loader import resolve_model_ref

logger = logging.getLogger("kiln.server")


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def build_app(
    state: ServerState,
    api_keys: Sequence[str] | None = None,
    max_request_body_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app serving ``state``'s engine."""
    app = FastAPI(title="Kiln", version=kiln.__version__)
    install_exception_handlers(app)
    # The last added runs first: errors, then the key, then the body limit.
    if max_request_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys))
    app.add_middleware(InternalErrorMiddleware)
    completion = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    models = OpenAIServingModels(state)
    tokenization = OpenAIServingTokenization(state)
    metrics = ServerMetrics(
        state.llm.stats, state.model_name, state.llm.max_model_len, state.options.metrics_prefix
    )
    app.state.kiln = state

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await completion.create(request, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(request, raw)

    add_responses_routes(app, OpenAIServingResponses(state, chat), bool(api_keys))

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(models.list_models())

    if state.options.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            return Response(await models.load_lora_adapter(request), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return Response(models.unload_lora_adapter(request), media_type="text/plain")

    stall = _StallWatch(state)

    @app.get("/health")
    async def health() -> Response:
        if state.llm.is_dead or state.draining or stall.stalled():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: as vLLM, for probes
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return _json(await tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _json(await tokenization.detokenize(request))

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": kiln.__version__})

    @app.get("/debug/plugins")
    async def debug_plugins() -> Response:
        """The engine core's report (it reported at start-up), with this process's under
        ``api_process``: the platform acts in the engine core (worker, ops, patches)."""
        from kiln.plugins.introspection import build_report
        from kiln.plugins.manager import get_plugin_manager

        api = build_report(get_plugin_manager(), state.llm.config, check_classes=False)
        ready = state.llm.client.ready
        if ready is None or not ready.plugin_report:
            return _json(api)
        return _json({**json.loads(ready.plugin_report), "api_process": api})

    register_pooling_routes(app, state)
    install_openapi(app, bool(api_keys))
    return app


class _StallWatch:
    """Whether an engine core is stalled (``AsyncMPClient.stalled_engines`` with
    ``--engine-stall-timeout``), logging each stall once when it starts and once when it ends."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.stalled_now: list[int] = []

    def stalled(self) -> bool:
        timeout = self.state.options.engine_stall_timeout
        stalled = self.state.llm.client.stalled_engines(timeout) if timeout > 0 else []
        if stalled and not self.stalled_now:
            logger.error(
                "engine core %s has requests waiting and sent nothing for over %.0f s: stalled "
                "(/health answers 503 until it is heard from again)",
                ", ".join(map(str, stalled)),
                timeout,
            )
        elif self.stalled_now and not stalled:
            logger.warning(
                "engine core %s is heard from again", ", ".join(map(str, self.stalled_now))
            )
        self.stalled_now = stalled
        return bool(stalled)


class _Server(uvicorn.Server):
    """uvicorn, with Kiln's shutdown: drain in-flight requests, then abort them, then exit 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.loop = asyncio.get_running_loop()
        self.drain_task: asyncio.Task | None = None
        self.engine_died = False

    async def exit_when_engine_dies(self) -> None:
        """Once the engine core is dead, stop like on SIGTERM: the requests in flight have
        been told, and get their answers; ``serve`` then returns 1."""
        await self.state.llm.wait_until_dead()
        logger.error("the engine core died: answering the requests in flight, then exiting")
        self.engine_died = True
        self.state.draining = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # ``serve`` routes SIGINT/SIGTERM to ``handle_exit`` through the event loop from before
        # uvicorn starts until the engine is stopped; uvicorn's own handlers would also re-raise
        # the signal after serving, killing the process before the engine is stopped.
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: stop accepting and drain; second: stop waiting and abort everything."""
        if self.should_exit:
            self.force_exit = True
            self.loop.call_soon_threadsafe(self.abort_all)
            return
        self.should_exit = True
        self.loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self.state.draining = True
        self.drain_task = asyncio.ensure_future(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        active = self.state.active_request_ids
        if active:
            logger.info(
                "%s: waiting up to %.0f s for %d request(s) to finish",
                signal_name,
                self.shutdown_timeout,
                len(active),
            )
        deadline = self.loop.time() + self.shutdown_timeout
        while active and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.abort_all()

    def abort_all(self) -> None:
        ids = list(self.state.active_request_ids)
        if ids:
            logger.warning("aborting %d request(s) still running", len(ids))
        for request_id in ids:
            asyncio.ensure_future(self.state.llm.abort(request_id))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _model_impl(config: KilnConfig, model_path: str) -> str:
    """The banner's line on which implementation runs the model (``--model-impl``)."""
    from kiln.model_executor.loader import get_loader
    from kiln.model_executor.registry import describe_model_impl

    hf_config = get_loader(model_path, config.model.load_format).load_hf_config(model_path)
    return describe_model_impl(hf_config.get("architectures") or [], config.model.model_impl)


def _banner(llm: AsyncLLM, state: ServerState, url: str, api_keys: Sequence[str] | None) -> str:
    ready = llm.client.ready
    assert ready is not None
    block_size = llm.config.cache.block_size
    concurrency = ready.kv_cache_tokens / llm.max_model_len
    pids = ", ".join(str(r.pid) for r in llm.client.readies)
    num_engines = len(llm.client.readies)
    engines = f"engine core pid {pids}"
    if num_engines > 1:
        engines = f"{num_engines} engine cores (data parallel), pids {pids}"
    per_engine = " per engine" if num_engines > 1 else ""
    return "\n".join(
        [
            f"Kiln {kiln.__version__} is serving {state.model_name}",
            f"  model      {state.model_path}",
            f"  runs as    {_model_impl(llm.config, state.model_path)}",
            f"  platform   {ready.platform} ({engines})",
            f"  start-up   {ready.startup_s:.1f} s (warm-up, graph capture {ready.warmup_s:.1f} s)",
            f"  KV cache   {ready.kv_cache_tokens:,} tokens ({ready.num_blocks:,} blocks of "
            f"{block_size}){per_engine}; max_model_len {llm.max_model_len:,}, so "
            f"{concurrency:.2f}x concurrency at full length{per_engine}",
            f"  URL        {url}  (OpenAI API: {url}/v1{', API key required' if api_keys else ''})",
        ]
    )


async def serve(args: argparse.Namespace, config: KilnConfig, sock: socket.socket) -> int:
    """Start the engine, serve until a signal (status 0) or the engine's death (status 1), shut
    down. Returns the exit status."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:  # while the model loads, a signal stops the start cleanly
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        log_level = logging.getLogger().getEffectiveLevel()
        try:
            llm = await AsyncLLM.create(config, log_level, log_stats=not args.disable_log_stats)
        except asyncio.CancelledError:
            logger.warning("interrupted while starting")
            return 1
        except EngineDeadError as exc:
            logger.error("%s", exc)
            return 1
        status = 0
        state: ServerState | None = None
        try:
            options = ServerOptions(
                trust_request_chat_template=args.trust_request_chat_template,
                max_n=args.max_n,
                max_response_logprobs=args.max_response_logprobs,
                tools=_tool_options(args),
                allow_runtime_lora_updating=_allow_runtime_lora_updating(args),
                max_lora_adapters=args.max_lora_adapters,
                metrics_prefix=args.metrics_prefix,
                engine_stall_timeout=args.engine_stall_timeout,
                responses_store_max_entries=args.responses_store_max_entries,
                responses_store_max_bytes=args.responses_store_max_bytes,
                responses_store_ttl=args.responses_store_ttl,
            )
            model_path = resolve_model_ref(config.model.model)
            state = ServerState(llm, llm.model_name, model_path, options=options)
            for name, path in parse_lora_modules(args.lora_modules):
                try:
                    OpenAIServingModels(state).add_lora(name, path)
                except OpenAIError as exc:
                    logger.error("--lora-modules %s=%s: %s", name, path, exc)
                    return 1
            shutdown_timeout = max(0.0, args.shutdown_timeout)
            server = _Server(
                uvicorn.Config(
                    build_app(state, args.api_key, args.max_request_body_bytes),
                    log_level=args.uvicorn_log_level,
                    lifespan="off",
                    timeout_graceful_shutdown=shutdown_timeout + 5,
                    timeout_keep_alive=5,
                ),
                state,
                shutdown_timeout,
            )
            # From here a signal drains (see _Server.capture_signals).
            for sig in signals:
                loop.add_signal_handler(sig, server.handle_exit, sig, None)
            host, port = sock.getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            print(_banner(llm, state, url, args.api_key), flush=True)
            watcher = asyncio.ensure_future(server.exit_when_engine_dies())
            await server.serve(sockets=[sock])
            watcher.cancel()
            if server.drain_task is not None and not server.drain_task.done():
                server.drain_task.cancel()
            server.abort_all()
            await asyncio.sleep(0)  # let the aborts go out
            status = 1 if server.engine_died else 0
        finally:
            llm.shutdown()
            if state is not None:
                state.executor.shutdown(wait=False, cancel_futures=True)
            logger.info("server stopped")
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return status


def run_server(args: argparse.Namespace) -> int:
    """``kiln serve``: returns the process exit status."""
    from kiln.plugins import init_process
    from kiln.plugins.manager import PlatformSelectionError

    try:
        config = init_process("api", EngineArgs.from_cli_args(args).create_config())
        _tool_options(args)  # parser names, once general plugins have registered theirs
        ResponseStore(  # the bounds' ValueError, before the model loads
            args.responses_store_max_entries,
            args.responses_store_max_bytes,
            args.responses_store_ttl,
        )
        if parse_lora_modules(args.lora_modules) and not config.lora.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
    except (ValueError, PlatformSelectionError) as exc:
        # A config the user can fix, or a platform Kiln refuses (none found, two, an API
        # version of another major, a name mismatch): one line, like any config error.
        print(f"kiln serve: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"kiln serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    try:
        return _run(serve(args, config, sock))
    finally:
        sock.close()


def _allow_runtime_lora_updating(args: argparse.Namespace) -> bool:
    """``--allow-runtime-lora-updating``, or ``KILN_ALLOW_RUNTIME_LORA_UPDATING`` set to true/1
    (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    env = os.environ.get("KILN_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    return bool(args.allow_runtime_lora_updating) or env in ("1", "true")


def _tool_options(args: argparse.Namespace) -> ToolServerOptions:
    return resolve_server_options(
        args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser
    )


def _run(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


__all__ = ["build_app", "run_server", "serve"]
