"""The ``kiln`` command: ``plugins``, ``serve``, ``bench serve``, ``chat``, ``models``,
``proxy``, ``export-tokenizer``."""

from __future__ import annotations

import argparse
import importlib
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


# Subcommands whose flags and ``main`` live in a module of their own: (name, module, help,
# description). The module is imported only when the parser is built for it (``build_parser``).
_MODULE_COMMANDS: dict[str, tuple[str, str, str]] = {
    "chat": (
        "kiln.entrypoints.chat",
        "chat in the terminal with a local model or a running server",
        "An interactive, streamed chat. /reset forgets the conversation, /exit leaves.",
    ),
    "models": (
        "kiln.entrypoints.models",
        "list every model architecture Kiln can serve, and how",
        "One row per architecture (config.json's architectures name): native or from a plugin "
        "(which), the GGUF architectures that load as it, and its class.",
    ),
    "proxy": (
        "kiln.entrypoints.proxy",
        "serve disaggregated prefill: prompts on prefill instances, decodes on others",
        "An OpenAI-compatible proxy speaking vLLM's disaggregated-prefill protocol: each "
        "completion runs its prompt on a --prefill instance (max_tokens=1, kv_transfer_params "
        "do_remote_decode) and its decode on a --decode instance, which pulls the prompt's KV "
        "blocks (P2pConnector). Round robin over several of each; /v1/models and /health pass "
        "through.",
    ),
    "export-tokenizer": (
        "kiln.entrypoints.export_tokenizer",
        "write the model's tokenizer as a Hugging Face folder (for eval and load tools)",
        "Write DIR: MODEL's tokenizer, chat template and config (no weights) as a folder that "
        "transformers' AutoTokenizer.from_pretrained loads, giving Kiln's token ids (for lm-eval, "
        "guidellm, aiperf).",
    ),
}


# Each subcommand's one-line help (the top-level ``kiln --help`` list).
_BRIEF = {
    "plugin": "tools for plugin authors",
    "serve": "serve a model with an OpenAI-compatible API",
    "bench": "benchmark a running server",
    **{name: brief for name, (_, brief, _) in _MODULE_COMMANDS.items()},
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kiln`` parser. With ``command`` (a subcommand's name), only that subcommand gets its
    flags and the others are bare names: building the serve, proxy and bench flags imports the
    server, which made every ``kiln plugins`` take 2 s longer. ``None``: every subcommand's."""
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
    builders = {
        "plugin": _add_plugin_parser,
        "serve": _add_serve_parser,
        "bench": _add_bench_parser,
    }
    for name in (*builders, *_MODULE_COMMANDS):
        if command not in (None, name):
            sub.add_parser(name, help=_BRIEF[name])
        elif name in builders:
            builders[name](sub)
        else:
            module, brief, description = _MODULE_COMMANDS[name]
            _add_module_command(
                sub, name, importlib.import_module(module), help=brief, description=description
            )
    return parser


def _add_plugin_parser(sub: argparse._SubParsersAction) -> None:
    from kiln.entrypoints import plugin_new

    plugin = sub.add_parser("plugin", help=_BRIEF["plugin"])
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
        help=_BRIEF["serve"],
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

    bench = sub.add_parser("bench", help=_BRIEF["bench"])
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


def _command_of(argv: list[str]) -> str:
    """The subcommand ``argv`` names ('' when none does: then only the top-level help runs)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?", default="")
    known, _ = pre.parse_known_args(argv)
    return str(known.command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
