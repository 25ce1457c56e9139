"""The offloading connector's CPU tier against none, offline, in one run.

Two workloads, each run on one engine with ``--kv-offloading-size`` and one without, the same
prompts (random token ids of the default model's vocabulary, so no chat template) and greedy
decoding:

- **Multi-turn chat:** ``--conversations`` conversations of ``--turns`` turns share a
  ``--system-tokens`` system prompt; each turn appends ``--user-tokens`` user tokens to the
  conversation so far (its earlier answers included) and generates ``--answer-tokens``.
  ``--concurrency`` conversations run at a time, round robin, so a conversation comes back after
  the others have pushed it out of a paged cache sized at a quarter of the working set
  (``--kv-share``). Prints the median time to first token of turns 2 and later.
- **One long prompt** (``--long-prompt`` tokens): prefilled, pushed out of the paged cache, then
  sent again; prints the first prefill's time against the second's and against the tier's own
  save and load seconds.

    .venv/bin/python benchmarks/kv_offload.py [--conversations 64] [--turns 6]
        [--system-tokens 1500] [--long-prompt 2000] [--offload-gib 4]

Run it on an idle machine: each figure is compared with the other engine's in the same run.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from kiln import LLM, SamplingParams
from kiln.model_executor.loader.default_model import default_model_path

GIB = 1 << 30


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def make_llm(args: argparse.Namespace, kv_gib: float, tier: str) -> LLM:
    """An engine with no connector (``tier`` "none"), the CPU tier ("offloading") or a CPU tier
    of one conversation's blocks over a disk tier in ``--disk-path`` ("disk")."""
    extra: dict[str, Any] = {}
    if tier == "offloading":
        extra["kv_offloading_size"] = args.offload_gib
    elif tier == "disk":
        options = {
            "cpu_bytes": int(kv_gib * GIB / 4),
            "disk_path": args.disk_path,
            "disk_bytes": int(args.offload_gib * GIB),
        }
        extra["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": options,
        }
    return LLM(
        default_model_path(),
        kv_cache_memory=kv_gib,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.concurrency, 4),
        **extra,
    )


def multi_turn(llm: LLM, args: argparse.Namespace) -> list[float]:
    """Time to first token (s) of every turn after the first, in order."""
    rng = random.Random(0)
    system = random_tokens(rng, args.system_tokens)
    histories = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    ttfts = []
    for turn in range(args.turns):
        for start in range(0, args.conversations, args.concurrency):
            group = range(start, min(start + args.concurrency, args.conversations))
            for i in group:
                histories[i] += random_tokens(rng, args.user_tokens)
            prompts = [{"prompt_token_ids": histories[i]} for i in group]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for i, output in zip(group, outputs, strict=True):
                histories[i] += output.outputs[0].token_ids
                if turn and output.metrics and output.metrics.time_to_first_token is not None:
                    ttfts.append(output.metrics.time_to_first_token)
    return ttfts


def long_prompt(llm: LLM, args: argparse.Namespace) -> tuple[float, float]:
    """Seconds of the long prompt's first prefill and of its second, after other prompts pushed
    it out of the paged cache."""
    rng = random.Random(1)
    prompt = {"prompt_token_ids": random_tokens(rng, args.long_prompt)}
    params = SamplingParams(temperature=0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    first = time.perf_counter() - start
    kv_tokens = llm.llm_engine.engine_core.kv_cache_tokens
    for _ in range(kv_tokens // args.long_prompt + 2):  # other prompts take every block
        other = {"prompt_token_ids": random_tokens(rng, args.long_prompt)}
        llm.generate([other], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-share", type=float, default=0.25)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--offload-gib", type=float, default=4.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--disk-path",
        help="also run the disk tier in this directory (its block files are removed at start), "
        "under a CPU tier a quarter of the paged cache",
    )
    args = parser.parse_args()

    probe = LLM(default_model_path(), kv_cache_memory=0.05, max_model_len=256)
    cache = probe.llm_engine.config.cache  # the engine core measured its bytes per block
    bytes_per_token = cache.bytes_per_block / cache.block_size
    del probe
    gc.collect()
    per_conversation = args.turns * (args.user_tokens + args.answer_tokens)
    working_set = args.system_tokens + args.conversations * per_conversation
    kv_gib = max(working_set * args.kv_share, args.max_model_len + 64) * bytes_per_token / GIB
    print(
        f"working set {working_set} tokens ({working_set * bytes_per_token / GIB:.2f} GiB); "
        f"paged cache {kv_gib:.3f} GiB; CPU tier {args.offload_gib} GiB"
    )
    results = {}
    tiers = ["none", "offloading"] + (["disk"] if args.disk_path else [])
    for name in tiers:
        llm = make_llm(args, kv_gib, name)
        ttfts = multi_turn(llm, args)
        first, second = long_prompt(llm, args)
        counters = dict(llm.llm_engine.stats.totals.kv_connector)
        results[name] = (statistics.median(ttfts), first, second, counters)
        print(
            f"{name:>10}: multi-turn median TTFT (turns 2+) {statistics.median(ttfts) * 1e3:.0f} ms"
            f" over {len(ttfts)} turns; long prompt {first * 1e3:.0f} ms, again after eviction "
            f"{second * 1e3:.0f} ms; connector {counters}"
        )
        del llm
        gc.collect()
    none = results["none"]
    for name in tiers[1:]:
        off = results[name]
        counters = off[3]
        copy = counters.get("save_seconds", 0.0) + counters.get("load_seconds", 0.0)
        print(f"multi-turn TTFT: none / {name} = {none[0] / off[0]:.2f}x")
        print(
            f"long prompt again ({name}): {off[2] * 1e3:.0f} ms against {none[2] * 1e3:.0f} ms "
            f"recomputed; every save and load of the run took {copy * 1e3:.0f} ms in all"
        )


if __name__ == "__main__":
    main()
