"""Embedding throughput: Kiln's offline ``LLM.embed`` (``runner="pooling"``) against
``transformers``' forward with the same pooling, same weights, same threads, in one run.

Both run the default model (SmolLM2-135M-Instruct; transformers dequantizes its GGUF) on the same
``--num-inputs`` random token-id inputs of ``--input-len`` tokens. Kiln pools with
``--pooling-type`` (LAST, MEAN or CLS) and L2-normalises; transformers runs its base model
(``last_hidden_state``, after the final norm) over batches of ``--hf-batch-size`` and pools and
normalises the same way. Prints inputs/s and tokens/s of both and the ratio; the first embeddings
of both are compared (their largest difference is printed) so a fast but wrong run shows.

    .venv/bin/python benchmarks/embed_bench.py [--num-inputs 256] [--input-len 128]
        [--pooling-type LAST] [--threads N] [--dtype float32] [--hf-batch-size 32]

Timings on a machine shared with other work are not comparable between runs; the ratio of one
run is the figure to read.
"""

from __future__ import annotations

import argparse
import time

import torch
from throughput import make_prompts

from kiln import LLM
from kiln.model_executor.loader.default_model import default_model_path
from kiln.pooling_params import PoolingParams
from kiln.testing.reference import hf_model_from_gguf


def bench_kiln(prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    """Seconds of one ``embed`` over ``prompts`` (after a warm-up), and the embeddings."""
    llm = LLM(
        runner="pooling",
        pooler_config={"pooling_type": args.pooling_type, "normalize": True},
        dtype=args.dtype,
        max_num_seqs=min(len(prompts), 256),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=1,
        plugin_config={"cpu": {"num_threads": args.threads}} if args.threads else None,
    )
    llm.embed(prompts[:2], PoolingParams(), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, torch.tensor([o.outputs.embedding for o in outputs])


def bench_transformers(
    prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, torch.Tensor]:
    """Seconds of transformers' forward and pooling over ``prompts`` in batches."""
    model = hf_model_from_gguf(default_model_path(), getattr(torch, args.dtype))
    model.config._attn_implementation = "sdpa"
    base = model.model
    vectors = []
    with torch.inference_mode():
        base(torch.tensor(prompts[:2]))  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch_size):
            hidden = base(torch.tensor(prompts[i : i + args.hf_batch_size])).last_hidden_state
            pooled = {
                "LAST": hidden[:, -1],
                "MEAN": hidden.mean(dim=1),
                "CLS": hidden[:, 0],
            }[args.pooling_type]
            vectors.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        elapsed = time.perf_counter() - start
    return elapsed, torch.cat(vectors)


def _rates(num_inputs: int, num_tokens: int, seconds: float) -> str:
    return f"{num_inputs / seconds:8.1f} inputs/s {num_tokens / seconds:10.0f} tokens/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--pooling-type", default="LAST", choices=["LAST", "MEAN", "CLS"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both engines)")
    parser.add_argument("--dtype", default="float32", help="compute dtype of both engines")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    prompts = make_prompts(args.num_inputs, args.input_len, 49152, args.seed)
    num_tokens = args.num_inputs * args.input_len
    shape = f"{args.num_inputs} inputs x {args.input_len} tokens, {args.pooling_type}"
    print(f"{shape}, {threads} threads")
    kiln_s, kiln_vectors = bench_kiln(prompts, args)
    print(f"kiln:         {_rates(args.num_inputs, num_tokens, kiln_s)}")
    torch.set_num_threads(threads)
    hf_s, hf_vectors = bench_transformers(prompts, args)
    print(f"transformers: {_rates(args.num_inputs, num_tokens, hf_s)}")
    print(f"ratio (kiln / transformers): {hf_s / kiln_s:.2f}x")
    print(f"largest difference of the embeddings: {(kiln_vectors - hf_vectors).abs().max():.2e}")


if __name__ == "__main__":
    main()
