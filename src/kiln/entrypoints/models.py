"""``kiln models``: every architecture Kiln can serve, and how.

One row per architecture of the model registry (``config.json``'s ``architectures`` names): the
class that serves it, who registered it (``kiln``: a native model; otherwise the plugin), and the
GGUF ``general.architecture`` names that load as it. General and platform plugins are loaded
first (their ``register()`` runs), as for ``kiln serve``, so a plugin's models are listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def list_models() -> list[dict[str, Any]]:
    """Every architecture Kiln serves: ``architecture``, ``class``, ``source`` (``"kiln"``, a
    plugin's name, or ``"transformers"``), ``how`` (``native``, ``plugin``, or ``transformers``:
    transformers' modeling code on Kiln's attention, for the causal LMs transformers implements
    and the registry does not) and ``gguf`` (GGUF names loading as it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from kiln.model_executor.loader.gguf_loader import gguf_architectures
    from kiln.model_executor.registry import MODEL_REGISTRY, TRANSFORMERS_BACKEND

    gguf: dict[str, list[str]] = {}
    for gguf_arch, hf_arch in gguf_architectures().items():
        gguf.setdefault(hf_arch, []).append(gguf_arch)
    rows = []
    for architecture, cls in sorted(MODEL_REGISTRY.items()):
        source = MODEL_REGISTRY.source_of(architecture)
        rows.append(
            {
                "architecture": architecture,
                "class": cls,
                "source": source,
                "how": "native" if source == "kiln" else "plugin",
                "gguf": sorted(gguf.get(architecture, [])),
            }
        )
    for architecture in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())):
        if architecture not in MODEL_REGISTRY:
            row = {"architecture": architecture, "class": TRANSFORMERS_BACKEND}
            rows.append({**row, "source": "transformers", "how": "transformers", "gguf": []})
    return rows


def main(args: argparse.Namespace) -> int:
    from kiln.engine.arg_utils import EngineArgs
    from kiln.plugins import init_process
    from kiln.plugins.manager import get_plugin_manager

    try:  # the platform's register() may add models too
        init_process("api", EngineArgs().create_config())
    except Exception:  # no platform (kiln plugins says why): the general plugins' models
        get_plugin_manager().load_general_plugins()
    rows = list_models()
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    header = ("architecture", "how", "registered by", "GGUF", "class")
    table = [header] + [
        (r["architecture"], r["how"], r["source"], ", ".join(r["gguf"]) or "-", r["class"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        sys.stdout.write("  ".join(cells).rstrip() + "\n")
    return 0
