"""``kiln export-tokenizer``: the folder it writes loads with transformers' ``AutoTokenizer`` and
gives Kiln's token ids and chat renderings, without weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kiln.entrypoints.export_tokenizer import TOKENIZER_CLASS, write_tokenizer
from kiln.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines",
    "Ünïcödé, 漢字 and emoji 🙂",
    "<|im_start|>user\nspecial tokens inside<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> Path:
    """The default model's folder, written as a user would: ``kiln export-tokenizer DIR``."""
    out_dir = tmp_path_factory.mktemp("tokenizer")
    command = [sys.executable, "-m", "kiln.entrypoints.cli", "export-tokenizer", str(out_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out_dir


def assert_same_ids(kiln: Tokenizer, hf: object) -> None:
    for text in TEXTS:
        assert hf.encode(text) == kiln.encode(text), text  # type: ignore[attr-defined]
        plain = hf.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        assert plain == kiln.encode(text, add_special_tokens=False), text


def test_folder_has_tokenizer_and_config_but_no_weights(exported: Path) -> None:
    names = set(os.listdir(exported))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
    assert sum(p.stat().st_size for p in exported.iterdir()) < 20 * 2**20
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == TOKENIZER_CLASS
    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"


def test_autotokenizer_gives_kilns_ids_and_chat(exported: Path, gguf_path: str) -> None:
    kiln = load_tokenizer(gguf_path)
    hf = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert len(hf) == kiln.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (kiln.bos_token_id, kiln.eos_token_id)
    assert_same_ids(kiln, hf)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = kiln.apply_chat_template(messages, add_generation_prompt)
            rendered = hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert rendered == expected
            assert hf.encode(rendered, add_special_tokens=False) == kiln.encode(
                expected, add_special_tokens=False
            )


@pytest.mark.parametrize("add_bos", [True, False])
def test_bos_policy_is_written_into_the_folder(
    tmp_path: Path, gguf_path: str, add_bos: bool
) -> None:
    """A model whose BOS policy differs from its HF tokenizer's post-processor (``add``: the
    default model told to add BOS; ``drop``: a folder that adds it, told not to) exports a folder
    whose ``encode`` follows the policy, as Kiln's does."""
    base = load_tokenizer(gguf_path)
    source = base.hf_tokenizer
    if not add_bos:  # a tokenizer whose post-processor adds BOS
        write_tokenizer(Tokenizer(source, add_bos=True), str(tmp_path / "adds"))
        source = AutoTokenizer.from_pretrained(tmp_path / "adds", local_files_only=True)
    kiln = Tokenizer(source, add_bos=add_bos, chat_template=base.chat_template)
    assert kiln.bos_fix == ("add" if add_bos else "drop")
    write_tokenizer(kiln, str(tmp_path / "out"))
    hf = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (hf.encode("a")[:1] == [kiln.bos_token_id]) is add_bos
    assert_same_ids(kiln, hf)
