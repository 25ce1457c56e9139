"""Smoke test: greedy generation on Kiln's paged KV cache, checked against transformers.

Loads the default model (SmolLM2-135M-Instruct GGUF) on the CPU platform, allocates a small paged KV
cache, and plays the model runner's part by hand for two requests: one batched prefill step, then
one-token decode steps for both together. Block ids are handed out from a shuffled free list, so
block tables are not contiguous. Prints each continuation, the timings, and whether the tokens equal
``transformers``' greedy tokens on the same GGUF file (MATCH / MISMATCH).

    .venv/bin/python examples/generate_smoke.py [--max-tokens 32] [--model PATH] [--no-compare]

The reference is ``kiln.testing.reference`` (transformers' own GGUF config and dequantization).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import (
    CommonAttentionMetadata,
    bind_kv_cache,
    get_attn_backend,
)
from kiln.model_executor.loader.default_model import default_model_path
from kiln.model_executor.model_loader import kv_cache_bytes_per_token, load_model
from kiln.testing.reference import hf_greedy, hf_model_from_gguf
from kiln.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "Here is a short poem about the sea:\n"]
BLOCK_SIZE = 16


class MiniRunner:
    """The model runner's job in miniature: KV caches, block tables, metadata, one step."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, dtype: torch.dtype) -> None:
        self.model = model
        backend = get_attn_backend()
        layers = model.attention_layers()
        first = next(iter(layers.values()))
        shape = backend.get_kv_cache_shape(
            num_blocks, BLOCK_SIZE, first.num_kv_heads, first.head_size
        )
        bind_kv_cache(model, {name: torch.zeros(shape, dtype=dtype) for name in layers})
        self.builder = backend.get_metadata_builder_cls()(BLOCK_SIZE, "cpu")
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.block_tables: list[list[int]] = []
        self.num_computed: list[int] = []

    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Run one step; ``new_tokens[i]`` are request i's new tokens. Returns [B, vocab] logits
        of each request's last new token."""
        while len(self.block_tables) < len(new_tokens):
            self.block_tables.append([])
            self.num_computed.append(0)
        ids: list[int] = []
        positions: list[int] = []
        for i, tokens in enumerate(new_tokens):
            start = self.num_computed[i]
            while len(self.block_tables[i]) * BLOCK_SIZE < start + len(tokens):
                self.block_tables[i].append(self.free_blocks.pop())
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
        common = CommonAttentionMetadata.from_block_tables(
            [len(t) for t in new_tokens], self.num_computed, self.block_tables, BLOCK_SIZE
        )
        metadata = self.builder.build(common)
        with set_forward_context(ForwardContext(attn_metadata=metadata, num_tokens=len(ids))):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))  # [T, hidden]
        logits = self.model.compute_logits(hidden[common.query_start_loc[1:].long() - 1])
        for i, tokens in enumerate(new_tokens):
            self.num_computed[i] += len(tokens)
        return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-compare", action="store_true", help="skip the transformers check")
    args = parser.parse_args()
    path = args.model or default_model_path()
    dtype = torch.float32
    torch.manual_seed(0)

    start = time.perf_counter()
    model, config = load_model(path, dtype, "cpu")
    load_s = time.perf_counter() - start
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    max_len = max(len(p) for p in prompts) + args.max_tokens
    num_blocks = len(prompts) * -(-max_len // BLOCK_SIZE) + 4
    runner = MiniRunner(model, num_blocks, dtype)
    cache_mib = num_blocks * BLOCK_SIZE * kv_cache_bytes_per_token(config, dtype) / 2**20
    print(
        f"model: {path}\n  {config['architectures'][0]}, loaded in {load_s:.2f} s; KV cache: "
        f"{num_blocks} blocks x {BLOCK_SIZE} tokens ({cache_mib:.1f} MiB)"
    )

    outputs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        start = time.perf_counter()
        logits = runner.step(prompts)
        prefill_ms = (time.perf_counter() - start) * 1e3
        decode_times = []
        for _ in range(args.max_tokens):
            next_ids = logits.argmax(-1).tolist()
            for out, token in zip(outputs, next_ids, strict=True):
                out.append(token)
            if len(outputs[0]) == args.max_tokens:
                break
            start = time.perf_counter()
            logits = runner.step([[t] for t in next_ids])
            decode_times.append(time.perf_counter() - start)

    for prompt, out in zip(PROMPTS, outputs, strict=True):
        print(f"--- {prompt!r}\n{prompt}{tokenizer.decode(out)}")
    decode_ms = 1e3 * sum(decode_times) / max(len(decode_times), 1)
    print(
        f"prefill: {sum(map(len, prompts))} tokens in {prefill_ms:.1f} ms; decode: "
        f"{decode_ms:.1f} ms/step for {len(prompts)} requests "
        f"({len(prompts) * 1e3 / decode_ms:.1f} tokens/s); threads: {torch.get_num_threads()}"
    )

    if args.no_compare:
        return 0
    hf_model = hf_model_from_gguf(path)
    reference = [hf_greedy(hf_model, prompt, args.max_tokens) for prompt in prompts]
    ok = True
    for i, (ours, ref) in enumerate(zip(outputs, reference, strict=True)):
        match = ours == ref
        ok &= match
        where = "" if match else f" (first difference at token {_first_diff(ours, ref)})"
        print(f"request {i}: {'MATCH' if match else 'MISMATCH'} vs transformers{where}")
    return 0 if ok else 1


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


if __name__ == "__main__":
    sys.exit(main())
