"""The flags of ``kiln serve``: the engine's (``EngineArgs.add_cli_args``, vLLM's names) plus the
server's. Importing this module is cheap (no FastAPI), so ``kiln --help`` stays fast."""

from __future__ import annotations

import argparse

from kiln.engine.arg_utils import EngineArgs

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
"""Below Kubernetes' default 30 s grace period, so in-flight requests end before a SIGKILL."""
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
"""16 MiB: room for a 128k-token prompt as text or token ids, far from what memory fears."""
DEFAULT_MAX_N = 128
"""OpenAI's cap on ``n``."""
DEFAULT_MAX_RESPONSE_LOGPROBS = 2**20
"""About 30-60 MB of JSON: room for n=8 x 2,048 tokens x top-20, or echoed logprobs of 16 prompts
of 8k tokens; a 10 kB request for n=128 x echo x logprobs=20 on 2,000 tokens (5.4M, ~150 MB) is
refused."""
DEFAULT_MAX_LORA_ADAPTERS = 256
"""Adapters clients may name at once (``--lora-modules`` and runtime loads)."""
DEFAULT_ENGINE_STALL_TIMEOUT_S = 30.0
"""Far above a step's length (a chunk of prefill takes well under a second), and below common
liveness-probe budgets (Kubernetes: three failures ten seconds apart)."""
DEFAULT_RESPONSES_STORE_MAX_ENTRIES = 10_000
DEFAULT_RESPONSES_STORE_MAX_BYTES = 256 * 2**20
DEFAULT_RESPONSES_STORE_TTL_S = 3600.0
"""An hour: an agent's conversation lives minutes; the store is memory, not a database."""
METRICS_PREFIXES = ("vllm", "kiln")
"""``--metrics-prefix`` choices; the first is the default."""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add every flag of ``kiln serve`` to ``parser``."""
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (may be "
        "given several times)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a `chat_template` sent in a request (Jinja from any client; refused with "
        "HTTP 400 unless this is set)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="BYTES",
        help="larger request bodies are refused with HTTP 413 (default: %(default)s)",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        metavar="N",
        help="the most completions (`n`) one request may ask for (default: %(default)s)",
    )
    g.add_argument(
        "--max-response-logprobs",
        type=int,
        default=DEFAULT_MAX_RESPONSE_LOGPROBS,
        metavar="N",
        help="the most logprob values one response may hold, counted before it runs as n x "
        "positions x (1 + top logprobs), positions being max_tokens plus the prompt's tokens "
        "when echoed or with prompt_logprobs; more is a 400 (default: %(default)s)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not log engine throughput and queue statistics every 10 s",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before they are aborted "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=DEFAULT_ENGINE_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="/health answers 503 while an engine core with requests waiting has sent nothing "
        "for this long (stopped, swapping, stuck); 0: never (default: %(default)s)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls from the model's answers (tool_choice 'auto', and requests with "
        "tools but no tool_choice); needs --tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3), "
        "llama3_json, or a name a plugin registered",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) clients may name in `model`: name=path items, or "
        'vLLM\'s JSON form \'{"name": "sql", "path": "/adapters/sql"}\'; needs --enable-lora',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
        "KILN_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    g.add_argument(
        "--max-lora-adapters",
        type=int,
        default=DEFAULT_MAX_LORA_ADAPTERS,
        metavar="N",
        help="the most LoRA adapters clients may name at once (--lora-modules and "
        "/v1/load_lora_adapter); loading one more is a 400 until one is unloaded "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--metrics-prefix",
        default=METRICS_PREFIXES[0],
        choices=METRICS_PREFIXES,
        help="prefix of the /metrics names: vllm (vLLM's names, which its Grafana dashboards "
        "query) or kiln (Kiln's earlier names, kiln:...)",
    )
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=DEFAULT_RESPONSES_STORE_MAX_ENTRIES,
        metavar="N",
        help="the most responses /v1/responses keeps for GET and previous_response_id (store: "
        "true), all API keys together; the oldest go first; 0: keep none "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_RESPONSES_STORE_MAX_BYTES,
        metavar="BYTES",
        help="the most bytes (as JSON) the stored responses and their conversations may hold; "
        "the oldest go first (default: %(default)s)",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_RESPONSES_STORE_TTL_S,
        metavar="SECONDS",
        help="how long a stored response is kept (default: %(default)s)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="log level of uvicorn (info logs each request)",
    )


__all__ = ["METRICS_PREFIXES", "add_server_args"]
