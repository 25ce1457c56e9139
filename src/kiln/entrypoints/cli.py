"""The ``kiln`` command: ``plugins``, ``serve``, ``bench serve``, ``chat``, ``models``,
``proxy``, ``export-tokenizer``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kiln.config import KilnConfig
from kiln.engine.arg_utils import ENGINE_FLAGS, EngineArgs


def _add_plugin_args(parser: argparse.ArgumentParser) -> None:
    for name in ("platform", "plugin_config"):  # the engine's flags, as `kiln serve` has them
        ENGINE_FLAGS[name].add_to(parser)


def cmd_plugins(args: argparse.Namespace) -> int:
    from kiln.plugins import init_process
    from kiln.plugins.introspection import build_report, format_report
    from kiln.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    config: KilnConfig | None = None
    error = None
    try:
        # from_kwargs: EngineArgs' fields are made from ENGINE_FLAGS, which mypy cannot see.
        config = EngineArgs.from_kwargs(
            platform=args.platform, plugin_config=args.plugin_config
        ).create_config()
        config = init_process("api", config)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        manager.discover()
    report = build_report(manager, config if error is None else None)
    if error is None:
        error = _class_errors(report)
    if error:
        report["error"] = error
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(report))
    return 1 if error else 0


def _class_errors(report: dict) -> str | None:
    """One line per named class that does not resolve or fails its interface check, naming the
    config field and who set it (the platform, or the user's config), and per plugin model that
    does not meet the model contract; None when all are ok."""
    platform = (report.get("platform") or {}).get("name", "?")
    set_by_platform = {change["field"] for change in report["config_changes"]}
    lines = []
    for c in report["classes"]:
        if c["status"] == "ok":
            continue
        field = f"device.{c['field']}"
        who = f"platform {platform!r}" if field in set_by_platform else "the config"
        lines.append(f"{field} = {c['class']} (set by {who}): {c['status']}")
    for m in report.get("models", []):
        if m["status"] != "ok":
            lines.append(
                f"model {m['architecture']} = {m['class']} (registered by {m['plugin']!r}): "
                f"{m['status']}"
            )
    return "; ".join(lines) or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: an LLM serving engine with pluggable hardware."
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="Python logging level (default: INFO for serve, WARNING otherwise)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser(
        "plugins",
        help="show plugins, the chosen platform and everything plugins changed",
        description="Show every plugin entry point and its status, each platform detector's "
        "verdict, the chosen platform and why, the config fields it set, registry overrides, "
        "patches and plugin config sections.",
    )
    _add_plugin_args(plugins)
    plugins.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plugins.set_defaults(func=cmd_plugins)
    _add_plugin_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    from kiln.entrypoints import chat, export_tokenizer, models, proxy

    _add_module_command(
        sub,
        "chat",
        chat,
        help="chat in the terminal with a local model or a running server",
        description="An interactive, streamed chat. /reset forgets the conversation, /exit leaves.",
    )
    _add_module_command(
        sub,
        "models",
        models,
        help="list every model architecture Kiln can serve, and how",
        description="One row per architecture (config.json's architectures name): native or "
        "from a plugin (which), the GGUF architectures that load as it, and its class.",
    )
    _add_module_command(
        sub,
        "proxy",
        proxy,
        help="serve disaggregated prefill: prompts on prefill instances, decodes on others",
        description="An OpenAI-compatible proxy speaking vLLM's disaggregated-prefill "
        "protocol: each completion runs its prompt on a --prefill instance (max_tokens=1, "
        "kv_transfer_params do_remote_decode) and its decode on a --decode instance, which pulls "
        "the prompt's KV blocks (P2pConnector). Round robin over several of each; /v1/models "
        "and /health pass through.",
    )
    _add_module_command(
        sub,
        "export-tokenizer",
        export_tokenizer,
        help="write the model's tokenizer as a Hugging Face folder (for eval and load tools)",
        description="Write DIR: MODEL's tokenizer, chat template and config (no weights) as a "
        "folder that transformers' AutoTokenizer.from_pretrained loads, giving Kiln's token ids "
        "(for lm-eval, guidellm, aiperf).",
    )
    return parser


def _add_plugin_parser(sub: argparse._SubParsersAction) -> None:
    from kiln.entrypoints import plugin_new

    plugin = sub.add_parser("plugin", help="tools for plugin authors")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", required=True)
    _add_module_command(
        plugin_sub,
        "new",
        plugin_new,
        help="write a new platform plugin package that passes the conformance kit",
        description="Write kiln-NAME/: a pyproject with both entry points, a platform with a "
        "config section, a worker, an attention backend, op implementations, the conformance "
        "kit's tests and a README (docs/plugins.md explains each file).",
    )


def _add_module_command(
    sub: argparse._SubParsersAction, name: str, module: Any, help: str, description: str
) -> None:
    """Subcommand ``name`` run by ``module.main(args)``, its flags from ``module.add_cli_args``."""
    parser = sub.add_parser(name, help=help, description=description)
    module.add_cli_args(parser)
    parser.set_defaults(func=module.main)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from kiln.entrypoints.openai.cli_args import add_server_args

    parser = sub.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible API",
        description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over HTTP with "
        "OpenAI's /v1/completions and /v1/chat/completions, plus /health, /metrics, /tokenize, "
        "/detokenize, /version and /debug/plugins. Flags follow `vllm serve`.",
    )
    add_server_args(parser)
    parser.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.entrypoints.openai.api_server import run_server

    return run_server(args)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kiln.bench import serve as bench_serve

    bench = sub.add_parser("bench", help="benchmark a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_module_command(
        bench_sub,
        "serve",
        bench_serve,
        help="load an OpenAI-compatible server and report throughput and latency",
        description="Stream fixed-length requests (ignore_eos) to an OpenAI-compatible server "
        "under a concurrency limit; report request and token throughput, TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, p99) as `vllm bench serve` does.",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
