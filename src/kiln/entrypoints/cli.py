"""The ``kiln`` command: ``kiln plugins`` (and, as they land, ``serve``, ``bench``, ``chat``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kiln.config import DeviceConfig, KilnConfig, PluginConfig


def _add_plugin_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--platform",
        default=None,
        help="force a platform by name (also KILN_PLATFORM); default: detect",
    )
    parser.add_argument(
        "--plugin-config",
        default=None,
        metavar="JSON",
        help='settings for plugins, e.g. \'{"name": {"key": 1}}\' (see `kiln plugins`)',
    )


def cmd_plugins(args: argparse.Namespace) -> int:
    from kiln.plugins import init_process
    from kiln.plugins.config import parse_plugin_config
    from kiln.plugins.introspection import build_report, format_report
    from kiln.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    config: KilnConfig | None = None
    error = None
    try:
        config = KilnConfig(
            device=DeviceConfig(platform=args.platform),
            plugins=PluginConfig(sections=parse_plugin_config(args.plugin_config)),
        )
        config = init_process("api", config)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        manager.discover()
    report = build_report(manager, config if error is None else None)
    if error:
        report["error"] = error
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(report))
    return 1 if error else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: an LLM serving engine with pluggable hardware."
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
