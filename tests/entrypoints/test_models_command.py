"""``kiln models`` (the installed command, in a subprocess): Kiln's native architectures with the
GGUF names that load as them, an architecture the test plugin registered, credited to it, and the
causal LMs served through transformers (``--model-impl auto``), not those Kiln has a class for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.plugin


def _models(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kiln.entrypoints.cli", "models", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_kiln_models_lists_native_and_plugin_architectures() -> None:
    done = _models("--json")
    assert done.returncode == 0, done.stderr
    rows = {row["architecture"]: row for row in json.loads(done.stdout)}
    llama = rows["LlamaForCausalLM"]
    assert (llama["how"], llama["source"], llama["gguf"]) == ("native", "kiln", ["llama"])
    assert rows["Qwen3ForCausalLM"]["gguf"] == ["qwen3"]
    plugin = rows["KilnTestForCausalLM"]
    assert (plugin["how"], plugin["source"]) == ("plugin", "kiln_test")
    neox = rows["GPTNeoXForCausalLM"]
    assert (neox["how"], neox["source"]) == ("transformers", "transformers")
    assert neox["class"].endswith("transformers_backend.TransformersForCausalLM")
    table = _models()
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split() == [
        "architecture",
        "how",
        "registered",
        "by",
        "GGUF",
        "class",
    ]
    assert any(
        line.split()[:3] == ["KilnTestForCausalLM", "plugin", "kiln_test"]
        for line in table.stdout.splitlines()
    )
