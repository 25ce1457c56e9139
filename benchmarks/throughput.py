"""Offline throughput: Kiln's ``LLM.generate`` against ``transformers`` batched ``generate``.

Both run the default model (SmolLM2-135M-Instruct, dequantized to float32) on the same prompts:
``--num-prompts`` random token-id prompts of ``--input-len`` tokens, ``--output-len`` new tokens
each with EOS ignored. Prints output tokens/s for both and the ratio, from the same run.

    .venv/bin/python benchmarks/throughput.py [--num-prompts 64] [--input-len 128]
        [--output-len 128] [--threads N] [--profile] [--skip-transformers]

``--profile`` also times ten decode steps of Kiln's engine under cProfile and prints where the
time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from kiln import LLM, SamplingParams
from kiln.model_executor.loader.default_model import default_model_path
from kiln.testing.reference import hf_model_from_gguf


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the special tokens (the first few hundred) so prompts are plain text.
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(num)]


def bench_kiln(
    prompts: list[list[int]], output_len: int, args: argparse.Namespace
) -> tuple[float, str]:
    llm = LLM(
        max_num_seqs=len(prompts),
        kv_cache_memory=1,
        max_num_batched_tokens=2048,
        dtype=args.dtype,
        plugin_config={"cpu": {"num_threads": args.threads}} if args.threads else None,
    )
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    if args.profile:
        profile_decode(llm, prompts, output_len)
    return len(prompts) * output_len / elapsed, llm.llm_engine.config.model.dtype


def profile_decode(llm: LLM, prompts: list[list[int]], output_len: int) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.engine_core.scheduler.running) or (
        engine.engine_core.scheduler.waiting
    ):
        engine.step()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(10):
        engine.step()
    profiler.disable()
    step_ms = (time.perf_counter() - start) * 100
    print(f"\nKiln decode step with {len(prompts)} requests: {step_ms:.1f} ms (under cProfile)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    engine.abort_request([f"profile-{i}" for i in range(len(prompts))])


def bench_transformers(prompts: list[list[int]], output_len: int, dtype: str) -> float:
    model = hf_model_from_gguf(default_model_path(), getattr(torch, dtype))
    model.config._attn_implementation = "sdpa"
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(input_ids[:2, :8], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
        elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), input_ids.shape[1] + output_len)
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both engines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="auto", help="compute dtype of both engines (auto: Kiln's platform pick)"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    prompts = make_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    shape = f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out"
    print(f"{shape}, {threads} threads")
    kiln_tps, kiln_dtype = bench_kiln(prompts, args.output_len, args)
    print(f"kiln ({kiln_dtype}):         {kiln_tps:8.1f} output tokens/s")
    if args.skip_transformers:
        return
    torch.set_num_threads(threads)
    hf_dtype = args.dtype if args.dtype != "auto" else kiln_dtype
    hf_tps = bench_transformers(prompts, args.output_len, hf_dtype)
    print(f"transformers ({hf_dtype}): {hf_tps:8.1f} output tokens/s")
    print(f"ratio (kiln / transformers): {kiln_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
