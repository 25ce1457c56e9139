"""Write a GGUF model as a Hugging Face folder (safetensors, config.json, tokenizer files).

Other engines (vLLM's CPU build) serve Hugging Face folders, not GGUF: this gives them the same
weights Kiln serves, dequantized by Kiln's own GGUF loader (the tensors come out under their
Hugging Face names) to float32, or rounded from there to bfloat16 or float16 (``--dtype``; the
checkpoint's ``torch_dtype`` says which), with the model's tokenizer and chat template.

    python benchmarks/export_hf.py OUT_DIR [--gguf PATH] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

from kiln.entrypoints.export_tokenizer import write_tokenizer
from kiln.model_executor.loader import get_loader, resolve_model_ref
from kiln.tokenizer import load_tokenizer

WEIGHTS_FILE = "model.safetensors"
DTYPES = ("float32", "bfloat16", "float16")


def is_exported(out_dir: str) -> bool:
    return all(
        os.path.isfile(os.path.join(out_dir, name))
        for name in ("config.json", WEIGHTS_FILE, "tokenizer.json")
    )


def export_hf(out_dir: str, gguf: str | None = None, dtype: str = "float32") -> str:
    """Write ``gguf`` (None: the default model) to ``out_dir`` with its weights in ``dtype`` (one
    of ``DTYPES``); returns ``out_dir``.

    Side effects: creates ``out_dir`` and overwrites ``config.json``, ``model.safetensors`` and
    the tokenizer files in it.

    Raises:
        ValueError: ``dtype`` not in ``DTYPES``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid; allowed: {list(DTYPES)}")
    model_ref = resolve_model_ref(gguf)
    loader = get_loader(model_ref)
    config = {k: v for k, v in loader.load_hf_config(model_ref).items() if v is not None}
    config["torch_dtype"] = dtype
    # Dequantized to float32 first, then rounded once: the GGUF values, nearest in ``dtype``.
    tensors = {
        name: tensor.to(getattr(torch, dtype)).contiguous()
        for name, tensor in loader.iter_weights(model_ref, torch.float32)
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(load_tokenizer(loader.tokenizer_source(model_ref)), out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: Kiln's default model)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the weights' dtype")
    args = parser.parse_args(argv)
    export_hf(args.out_dir, args.gguf, args.dtype)
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
