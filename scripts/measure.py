"""The structural measures of issue 10, rerunnable on any commit: lines under ``src/kiln``, lines of
the plugin machinery, import arrows between Kiln's packages (and which run upward), and
``duplicates src`` pairs.

How each is counted:
- lines: every line of every ``.py`` file (``wc -l``), blank lines and docstrings included.
- plugin machinery: the lines under ``plugins/``, ``patches/``, ``platforms/`` and ``testing/``.
- import arrows: the distinct ordered pairs (unit A, unit B) where a module of A imports a module
  of B, A != B, counting imports inside functions too. A unit is a top-level package or module of
  ``kiln`` (``kiln.scheduler``, ``kiln.config``), except the modules ``UNITS_ON_THEIR_OWN`` names,
  which are units of their own (a package whose parts sit in different layers).
- upward arrow: an arrow into a higher layer of ``LAYERS``. Within one layer arrows are allowed.
- ``duplicates src`` pairs: the count on the first line of ``duplicates --repo src``.

The request path's hops and representations are counted by hand; ``docs/architecture.md`` lists
them.

Usage: ``.venv/bin/python scripts/measure.py`` (from the repository root).
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kiln"
PLUGIN_MACHINERY = ("plugins", "patches", "platforms", "testing")

LAYERS: list[list[str]] = [
    # What everything may use: plain data, config, wire messages, the registry type, the
    # interface checks, the plugin config sections.
    ["utils", "config", "sampling_params", "pooling_params", "outputs", "forward_context",
     "messages", "plugins.registry", "plugins.interfaces", "plugins.config", "lora.request"],
    ["patches"],
    # The parts of a forward; hardware-independent; they do not pick a platform.
    # LoRA: adapter folders, the lora_apply op and the runner's adapter slots. Speculative
    # decoding: proposers and the rejection sampler.
    ["model_executor", "sampling", "distributed", "lora", "spec_decode"],
    # Platforms fill the op and class seams of the layers below; the tokenizer reads GGUF files.
    ["platforms", "tokenizer", "tokenizer_cache"],
    # Discovery, selection, lifecycle, introspection of plugins.
    ["plugins"],
    # Scheduling and the KV cache: token ids only; structured outputs' grammars and bitmasks,
    # which the scheduler fills and the front end checks at admission; the reasoning parsers,
    # which split the chat route's answers and tell the engine core where an answer starts.
    # KV connectors: the scheduler asks them for blocks, the worker runs their copies.
    ["scheduler", "structured_output", "reasoning", "kv_transfer"],
    ["worker", "executor"],
    # The front end (input and output processing) and the engine core's loop and process.
    ["engine"],
    ["entrypoints", "bench", "testing"],
    # What plugins import: names re-exported from every layer below; nothing in Kiln imports it.
    ["plugin_api"],
]  # fmt: skip
"""Kiln's layers, lowest first: a module may import its own layer and the layers below it."""

UNITS_ON_THEIR_OWN = ("plugins.registry", "plugins.interfaces", "plugins.config", "lora.request")
"""Modules that are units of their own, apart from their package (listed in ``LAYERS``)."""


def unit_of(dotted: str) -> str:
    """The unit of module ``kiln.x.y`` (``dotted`` without the ``kiln.`` prefix)."""
    for unit in UNITS_ON_THEIR_OWN:
        if dotted == unit or dotted.startswith(unit + "."):
            return unit
    return dotted.split(".")[0]


def layer_of(unit: str) -> int:
    for index, layer in enumerate(LAYERS):
        if unit in layer:
            return index
    raise ValueError(f"unit {unit!r} is in no layer of LAYERS: add it there")


def import_arrows(src: pathlib.Path = SRC) -> dict[tuple[str, str], list[str]]:
    """``(from unit, to unit) -> ["path:line", ...]`` for every import between two units."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        source = unit_of(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # ``from kiln.plugins import registry`` imports the unit plugins.registry.
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                on_own = [n for n in names if unit_of(n[len("kiln.") :]) in UNITS_ON_THEIR_OWN]
                targets = on_own if len(on_own) == len(names) else [node.module, *on_own]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            # The root package ``kiln`` only forwards names lazily; it is no unit.
            units = {unit_of(t[len("kiln.") :]) for t in targets if t.startswith("kiln.")}
            for target in units - {source}:
                where = f"{path.relative_to(src.parent)}:{node.lineno}"
                arrows.setdefault((source, target), []).append(where)
    return arrows


def upward_arrows(src: pathlib.Path = SRC) -> dict[tuple[str, str], list[str]]:
    """The arrows of ``import_arrows`` into a higher layer."""
    return {
        (a, b): where for (a, b), where in import_arrows(src).items() if layer_of(b) > layer_of(a)
    }


def count_lines(paths: list[pathlib.Path]) -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in paths)


def duplicate_pairs() -> int | None:
    """The pairs ``duplicates --repo src`` counts; None when the tool is not installed."""
    tool = shutil.which("duplicates")
    if tool is None:
        return None
    result = subprocess.run(
        [tool, "--repo", str(ROOT / "src"), "--seconds", "120"],
        capture_output=True,
        text=True,
        check=False,
    )
    first_line = (result.stdout.splitlines() or ["0"])[0]
    return int(first_line.split()[0])  # "26 pairs of places (...)"


def main() -> int:
    files = sorted(SRC.rglob("*.py"))
    machinery = [p for p in files if p.relative_to(SRC).parts[0] in PLUGIN_MACHINERY]
    arrows = import_arrows()
    upward = upward_arrows()
    print(f"lines under src/kiln: {count_lines(files)}")
    print(f"plugin machinery lines ({', '.join(PLUGIN_MACHINERY)}): {count_lines(machinery)}")
    print(f"import arrows between units: {len(arrows)}, upward: {len(upward)}")
    for (a, b), where in sorted(upward.items()):
        print(f"  {a} -> {b}: {', '.join(where)}")
    print(f"duplicates src pairs: {duplicate_pairs()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
