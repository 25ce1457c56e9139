"""``kiln export-tokenizer DIR [MODEL]``: the model's tokenizer as a Hugging Face folder.

Eval and load tools (lm-eval, guidellm, aiperf) count tokens with ``transformers``'
``AutoTokenizer.from_pretrained(DIR)``; Kiln serves GGUF files, which they cannot read. This
writes, without weights: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template
and ``tokenizer_class: PreTrainedTokenizerFast``, a class transformers 4.x and 5.x both have),
``chat_template.jinja``, and the model's ``config.json`` and ``generation_config.json`` (its stop
ids). The folder encodes as Kiln does: its BOS policy is written into the tokenizer's
post-processor, so ``encode`` gives Kiln's ids, and its chat template renders as Kiln's.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kiln.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_LOAD_TIME_KEYS = ("backend", "is_local", "local_files_only")
"""What transformers 5 writes into ``tokenizer_config.json`` that only describes that load."""


def write_tokenizer(tokenizer: Tokenizer, out_dir: str) -> None:
    """Write ``tokenizer`` (and its chat template) to ``out_dir`` as Hugging Face files.

    Side effects: creates ``out_dir``; overwrites its tokenizer files.
    """
    hf = tokenizer.hf_tokenizer
    if isinstance(tokenizer.chat_template, str):
        hf.chat_template = tokenizer.chat_template
    hf.save_pretrained(out_dir)
    if tokenizer.bos_fix is not None:
        _write_bos_policy(os.path.join(out_dir, "tokenizer.json"), hf, tokenizer.bos_fix)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    config = _read(config_path)
    for key in _LOAD_TIME_KEYS:
        config.pop(key, None)
    config["tokenizer_class"] = TOKENIZER_CLASS
    if isinstance(tokenizer.chat_template, str):
        config["chat_template"] = tokenizer.chat_template  # transformers < 4.43 reads it here
    _write(config_path, config)


def _write_bos_policy(path: str, hf: Any, bos_fix: str) -> None:
    """Make the saved tokenizer add BOS (``"add"``) or not (``"drop"``), as Kiln's encode does."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.processors import TemplateProcessing

    fast = FastTokenizer.from_file(path)
    if bos_fix == "add":
        bos = hf.bos_token
        special = [(bos, hf.bos_token_id)]
        fast.post_processor = TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=special
        )
    else:
        fast.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    fast.save(path)


def export_tokenizer(out_dir: str, model: str | None = None) -> str:
    """Write the tokenizer folder of ``model`` (None: the embedded default model) to
    ``out_dir``; returns ``out_dir``. Reads no weights.

    Raises:
        FileNotFoundError / ValueError: as ``load_tokenizer`` and the model's loader.
    """
    from kiln.model_executor.loader import get_loader, resolve_model_ref

    model_ref = resolve_model_ref(model)
    loader = get_loader(model_ref)
    tokenizer = load_tokenizer(loader.tokenizer_source(model_ref))
    config = {k: v for k, v in loader.load_hf_config(model_ref).items() if v is not None}
    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(tokenizer, out_dir)
    _write(os.path.join(out_dir, "config.json"), config)
    generation: dict[str, int | list[int]] = {"eos_token_id": sorted(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    _write(os.path.join(out_dir, "generation_config.json"), generation)
    return out_dir


def _read(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="the folder to write (created if missing)")
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a GGUF file, a Hugging Face folder or hub id (default: the embedded model)",
    )


def main(args: argparse.Namespace) -> int:
    out_dir = export_tokenizer(args.dir, args.model)
    print(f"wrote the tokenizer of {args.model or 'the default model'} to {out_dir}")
    return 0


__all__ = ["export_tokenizer", "write_tokenizer"]
