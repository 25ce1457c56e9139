"""The throughput cost of ``batch_invariant=True``: the same ``LLM.generate`` workload with the
mode off (baseline) and on, in one run, on the same prompts and dtype (bfloat16).

Two workloads: ``uniform`` (every prompt ``--input-len`` tokens) and ``mixed`` (prompt lengths
spread over 16 to 2 x ``--input-len``, so decodes of many lengths share a step: the mode's
attention makes one call per power-of-two length group). Each engine runs each workload
``--repeats`` times, alternating with the other engine so that load from other processes hits
both alike; the best run of each is reported.

    .venv/bin/python benchmarks/batch_invariant.py [--num-prompts 64] [--input-len 128]
        [--output-len 128] [--threads N] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import time

from throughput import make_prompts

from kiln import LLM, SamplingParams


def mixed_prompts(num: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [p[: rng.randint(16, max_len)] for p in make_prompts(num, max_len, vocab, seed)]


def build(batch_invariant: bool, args: argparse.Namespace) -> LLM:
    llm = LLM(
        dtype="bfloat16",
        batch_invariant=batch_invariant,
        max_num_seqs=args.num_prompts,
        kv_cache_memory=1,
        max_num_batched_tokens=2048,
        plugin_config={"cpu": {"num_threads": args.threads}} if args.threads else None,
    )
    llm.generate([[1000, 1001, 1002]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of one ``generate`` over ``prompts``."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    engines = {"default": build(False, args), "batch_invariant": build(True, args)}
    vocab = engines["default"].llm_engine.engine_core.executor.worker.model_runner.vocab_size
    workloads = {
        "uniform": make_prompts(args.num_prompts, args.input_len, vocab, args.seed),
        "mixed": mixed_prompts(args.num_prompts, 2 * args.input_len, vocab, args.seed),
    }
    print(
        f"{args.num_prompts} prompts, {args.input_len} input tokens (mixed: 16-"
        f"{2 * args.input_len}), {args.output_len} output tokens, bfloat16, best of "
        f"{args.repeats}"
    )
    print(f"{'workload':10s} {'default tok/s':>14s} {'batch_invariant tok/s':>22s} {'ratio':>7s}")
    for name, prompts in workloads.items():
        best = dict.fromkeys(engines, 0.0)
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                best[mode] = max(best[mode], run(llm, prompts, args.output_len))
        ratio = best["batch_invariant"] / best["default"]
        print(f"{name:10s} {best['default']:14.1f} {best['batch_invariant']:22.1f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
