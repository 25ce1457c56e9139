"""Offline throughput of pipeline parallelism with batches in flight, against one batch at a time
and against tensor parallelism, measured the same way in one run.

For each repeat, and for each configuration in turn (interleaved, so a change in the machine's
load hits every one alike): build an ``LLM`` of the model with dense weights (what more than one
rank loads) and no decode graphs (none are captured with more than one rank), TP=1 too, for an
equal comparison; warm it up, and time ``generate`` of
``--num-prompts`` random prompts of ``--input-len`` tokens and exactly ``--output-len`` new tokens
each (greedy, ``ignore_eos``), all submitted at once. Prints output tokens/s per configuration,
the best over the repeats, and its ratio to the first configuration.

Configurations (``--configs``, comma-separated):
- ``tp1``: one process.
- ``tp2``: two tensor-parallel ranks.
- ``pp2``: two pipeline stages, up to two batches in flight (the engine's default).
- ``pp2-serial``: the same engine, one batch at a time: the engine core's batch queue and the
  scheduler's micro-batches turned off in this process (the ablation of what they buy).

On a bigger machine (a stage's share of the cores each):

    .venv/bin/python benchmarks/pipeline_parallel.py --configs tp1,pp2-serial,pp2,tp2,pp4 \\
        --num-prompts 64 --input-len 128 --output-len 128 [--model MODEL] [--dtype bfloat16]

(``ppN``/``tpN`` take any size the model's layers or heads allow.)
"""

from __future__ import annotations

import argparse
import os
import random
import time

from kiln import LLM, SamplingParams


def make_prompts(num: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # Ids above the special tokens (the first few hundred) so prompts are plain text.
    return [
        {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(length)]}
        for _ in range(num)
    ]


def build(config: str, args: argparse.Namespace) -> LLM:
    """The ``LLM`` of ``config`` (see the module docstring)."""
    kind, _, rest = config.partition("-")
    size = int(kind[2:])
    name = "pipeline_parallel_size" if kind.startswith("pp") else "tensor_parallel_size"
    parallel = {name: size}
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization="none",
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.num_prompts,
        graph_capture_sizes=(),  # eager everywhere: more than one rank captures no graphs
        **parallel,
    )
    if rest == "serial":
        core = llm.llm_engine.engine_core
        core.batch_queue = None  # step() runs schedule -> execute -> update, one batch at a time
        scheduler = core.scheduler
        scheduler._max_num_batch_reqs = lambda: scheduler.max_num_seqs  # no micro-batches
    elif rest:
        raise ValueError(f"configuration {config!r}: allowed suffix: '-serial'")
    return llm


def measure(config: str, prompts: list[dict], args: argparse.Namespace) -> tuple[float, int]:
    """Output tokens/s of ``generate(prompts)``, and the most batches that were in flight."""
    llm = build(config, args)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        core = llm.llm_engine.engine_core
        core.max_num_batches_in_flight = 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
        return len(prompts) * args.output_len / elapsed, core.max_num_batches_in_flight
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tp1,pp2-serial,pp2,tp2")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    configs = args.configs.split(",")
    prompts = make_prompts(args.num_prompts, args.input_len)
    best: dict[str, float] = {}
    for repeat in range(args.repeats):
        for config in configs:
            load = os.getloadavg()[0]
            tput, in_flight = measure(config, prompts, args)
            print(
                f"repeat {repeat} {config}: {tput:.1f} output tok/s, at most {in_flight} "
                f"batch(es) in flight, load {load:.1f}-{os.getloadavg()[0]:.1f}",
                flush=True,
            )
            best[config] = max(best.get(config, 0.0), tput)
    base = best[configs[0]]
    print(f"\nbest of {args.repeats} (load now {os.getloadavg()[0]:.1f}):")
    for config in configs:
        print(f"  {config:12s} {best[config]:8.1f} output tok/s  ({best[config] / base:.2f}x)")


if __name__ == "__main__":
    main()
