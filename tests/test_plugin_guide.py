"""docs/plugins.md cannot rot: its code blocks are checked and run.

- Blocks tagged ``file=PATH`` must be, byte for byte, the files ``kiln plugin new toy`` writes, and
  the guide must show every source file of that package.
- Blocks tagged ``run`` are run in order, as one bash script, in a fresh virtual environment that
  reuses this environment's packages: they scaffold the package, install it with pip, run the
  conformance kit on it and ``kiln plugins``. ``exit=N`` says the block must exit with ``N``.
- ``text`` blocks are illustrations; no other block is allowed.
- The contract tables name every member of every interface and every op Kiln defines.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.entrypoints.plugin_new import render_plugin

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass
class Block:
    lang: str
    tags: dict[str, str]
    """``file=PATH`` -> {"file": PATH}; a bare word -> {word: ""}."""
    code: str
    line: int


def guide_blocks(text: str) -> list[Block]:
    blocks = []
    for match in FENCE.finditer(text):
        tags = {}
        for word in match.group(2).split():
            key, _, value = word.partition("=")
            tags[key] = value
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(match.group(1), tags, match.group(3), line))
    return blocks


@pytest.fixture(scope="module")
def blocks() -> list[Block]:
    return guide_blocks(GUIDE.read_text())


def test_every_block_is_checked(blocks: list[Block]) -> None:
    unchecked = [
        f"line {b.line}: ```{b.lang} {' '.join(b.tags)}"
        for b in blocks
        if "file" not in b.tags and "run" not in b.tags and b.lang != "text"
    ]
    assert blocks and not unchecked, f"blocks neither file=, run nor text: {unchecked}"


def test_file_blocks_are_what_the_scaffold_writes(blocks: list[Block]) -> None:
    scaffold = render_plugin("toy")
    shown = {b.tags["file"]: b for b in blocks if "file" in b.tags}
    for path, block in shown.items():
        assert path in scaffold, f"line {block.line}: the scaffold writes no {path}"
        assert block.code == scaffold[path], (
            f"line {block.line}: {path} differs from what `kiln plugin new toy` writes"
        )
    missing = {p for p in scaffold if p.endswith((".py", ".toml"))} - set(shown)
    assert not missing, f"the guide does not show {sorted(missing)}"


def test_line_counts_in_the_guide_are_the_scaffolds() -> None:
    sources = [c for p, c in render_plugin("toy").items() if p.startswith("src/")]
    lines = sum(len(c.splitlines()) for c in sources)
    code = sum(_code_lines(c) for c in sources)
    claim = re.search(r"are (\d+) lines, (\d+) of them code", GUIDE.read_text())
    assert claim, "the guide no longer says how long the package is"
    assert (int(claim.group(1)), int(claim.group(2))) == (lines, code)
    assert code < 200, "the issue's bar: a platform with its own worker, attention and ops"


def _code_lines(source: str) -> int:
    """Lines that are neither blank, comments nor docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def _public_members(cls: type) -> set[str]:
    names = set()
    for klass in cls.__mro__[:-1]:
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if callable(value) or isinstance(value, (classmethod, staticmethod, str, tuple)):
                names.add(name)
    return names


def test_contract_tables_name_every_member() -> None:
    from kiln.distributed.communicator import Communicator
    from kiln.messages import SchedulerOutput
    from kiln.model_executor import layers
    from kiln.model_executor.custom_op import OP_REGISTRY
    from kiln.model_executor.layers import attention
    from kiln.model_executor.loader.base import ModelLoader
    from kiln.platforms.interface import Platform
    from kiln.spec_decode.interface import ProposerBase, RejectionSamplerBase
    from kiln.testing import conformance
    from kiln.worker.graph import GraphWrapper
    from kiln.worker.worker_base import ModelRunnerBase, WorkerBase

    text = GUIDE.read_text()
    interfaces = [
        Platform,
        WorkerBase,
        ModelRunnerBase,
        attention.AttentionBackend,
        attention.AttentionImpl,
        attention.AttentionMetadataBuilder,
        Communicator,
        GraphWrapper,
        ModelLoader,
        ProposerBase,
        RejectionSamplerBase,
    ]
    missing = [
        f"{cls.__qualname__}.{name}"
        for cls in interfaces
        for name in sorted(_public_members(cls))
        if f"`{name}" not in text
    ]
    for record in (attention.CommonAttentionMetadata, SchedulerOutput):
        fields = inspect.signature(record).parameters
        missing += [f"{record.__name__}.{f}" for f in fields if f"`{f}`" not in text]
    for module in pkgutil.walk_packages(layers.__path__, layers.__name__ + "."):
        importlib.import_module(module.name)  # every layer module: every op Kiln defines
    # Kiln's own ops only: a test plugin loaded earlier in this process may have added its own.
    kiln_ops = [
        name
        for name in OP_REGISTRY.ops.names()
        if OP_REGISTRY.ops.get(name).__module__.startswith("kiln.")
    ]
    missing += [f"op {name}" for name in kiln_ops if f"| `{name}` |" not in text]
    missing += [f"kit {name}" for name in conformance.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/plugins.md does not document {missing}"


def _fresh_venv(root: Path) -> Path:
    """A virtual environment whose site-packages adds this one's (torch, Kiln, pip, pytest), with
    a ``kiln`` command: installing there costs seconds, not a torch download."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    parent = sysconfig.get_paths()["purelib"]
    (site / "site-packages" / "kiln_parent.pth").write_text(
        f"import site; site.addsitedir({parent!r})\n"
    )
    kiln = venv / "bin" / "kiln"
    # What pip writes for a console script (the guard matters: kiln serve spawns processes
    # that re-import the main module).
    kiln.write_text(
        f"#!{venv / 'bin' / 'python'}\nimport sys\n"
        "from kiln.entrypoints.cli import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    kiln.chmod(0o755)
    return venv


def _script(blocks: list[Block]) -> str:
    lines = ["set -euo pipefail"]
    for block in blocks:
        if "run" not in block.tags:
            continue
        want = int(block.tags.get("exit") or 0)
        lines.append(f"echo '>>> guide block at line {block.line}'")
        if want == 0:
            # In the script's own shell: the next block runs where this one left off (cd,
            # export), and a failing command stops the script.
            lines.append(block.code)
            continue
        lines += [
            "set +e",
            f"( set -e\n{block.code})",
            "rc=$?",
            "set -e",
            f'[ "$rc" = {want} ] || {{ echo "line {block.line}: exit $rc, not {want}"; exit 97; }}',
        ]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.plugin
def test_guide_commands_scaffold_install_and_pass_the_kit(
    blocks: list[Block], tmp_path: Path
) -> None:
    venv = _fresh_venv(tmp_path)
    # A fresh shell, as an author's: no pytest or pip settings, no platform or plugin choice
    # left behind by an earlier test.
    dropped = ("PYTEST_", "PIP_", "KILN_PLATFORM", "KILN_PLUGINS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(venv),
        # Offline: the build backend (setuptools) comes from the parent environment.
        PIP_NO_BUILD_ISOLATION="0",
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    proc = subprocess.run(
        ["bash", "-c", _script(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    kit = re.search(r"^(\d+) passed[^\n]*$", output, re.MULTILINE)
    assert kit and int(kit.group(1)) >= 6, f"the kit did not pass:\n{output[-6000:]}"
    # Optional kit modes may skip; at least the six core checks passed, and nothing failed.
    assert not re.search(r"\d+ (failed|error)", kit.group(0)), kit.group(0)
    assert "Platform: toy (kiln_toy.platform.ToyPlatform" in output, output[-3000:]
    assert "--plugin-config toy" in output and "num_threads=0 is invalid" in output
