"""Speculative decoding at concurrency 1: ngram or draft-model speculation against none, in one run.

Two workloads (greedy, chat template; the target is the default model unless ``--model``):
- ``repetitive``: "repeat this code with one change" over a few functions, where the answer
  copies most of the prompt (what prompt lookup is for);
- ``open``: open questions, whose answers copy little (the cost of looking up for nothing).

``--method draft_model`` drafts with ``--draft-model`` (default: the default model's GGUF file,
so with ``--model`` a float export of it from ``benchmarks/export_hf.py`` the draft is the same
network, quantized). Each prompt is generated alone (concurrency 1), by one engine without
speculation and one with ``--speculative-config`` in the same process, alternating prompt by
prompt so that load from other processes hits both alike; each (engine, workload) is run
``--repeats`` times and the best is reported. Prints output tokens per second of each, their
ratio (of the bests; of each round, a round running every prompt once on both engines; and of
output tokens per second of the calling thread's CPU time over all rounds, which load from other
processes barely moves where the model runs on that thread, as with one model thread), the
acceptance rate and mean accepted length, and how many answers are identical (greedy is token
for token the same up to numerics: a verification step computes several tokens of a request in
one step, and an attention kernel may round a query row differently then; see
docs/speculative-decoding.md).

    .venv/bin/python benchmarks/speculative.py [--num-speculative-tokens 4]
        [--prompt-lookup-max 4] [--max-tokens 192] [--repeats 2] [--dtype auto]
        [--quantization none] [--model PATH] [--method draft_model] [--draft-model PATH]
        [--draft-quantization auto]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kiln import LLM, SamplingParams
from kiln.engine.stats import spec_decode_rates
from kiln.model_executor.loader.default_model import default_model_path

FUNCTIONS = [
    '''def parse_header(line):
    """Split a 'Key: value' header line into a (key, value) pair."""
    key, _, value = line.partition(":")
    key = key.strip().lower()
    value = value.strip()
    if not key:
        raise ValueError("empty header name")
    return key, value''',
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = sum(values[:window])
    result.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result''',
    """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self):
        return max(self.counts, key=self.counts.get)""",
]
CHANGES = ["rename the function's first argument to `text`", "add type hints", "use a for loop"]
OPEN = [
    "Why is the sky blue? Explain in a paragraph.",
    "Give three tips for learning a new language.",
    "Describe a busy market on a Saturday morning.",
]


def workloads() -> dict[str, list[list[dict[str, str]]]]:
    repetitive = [
        [{"role": "user", "content": f"Repeat this code with one change: {change}.\n\n{code}"}]
        for code, change in zip(FUNCTIONS, CHANGES, strict=True)
    ]
    return {"repetitive": repetitive, "open": [[{"role": "user", "content": q}] for q in OPEN]}


def build(args: argparse.Namespace, speculative: dict | None) -> LLM:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=4,
        kv_cache_memory=0.5,
        speculative_config=speculative,
    )
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def run_one(
    llm: LLM, conversation: list[dict[str, str]], max_tokens: int
) -> tuple[int, float, float, str]:
    """Tokens, seconds, this thread's CPU seconds and text of one request alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start, start_cpu = time.perf_counter(), time.thread_time()
    output = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
    cpu = time.thread_time() - start_cpu
    return len(output.token_ids), time.perf_counter() - start, cpu, output.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization", default=None, help="model.quantization (none: dense weights)"
    )
    parser.add_argument("--model", default=None, help="the target (default: the default model)")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    parser.add_argument(
        "--draft-model", default=None, help="draft_model: the draft (default: the default GGUF)"
    )
    parser.add_argument("--draft-quantization", default=None, help="the draft's quantization")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    speculative: dict = {
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if args.method == "ngram":
        speculative |= {
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    else:
        speculative |= {
            "model": args.draft_model or default_model_path(),
            "quantization": args.draft_quantization,
        }
    method = args.method
    engines = {"none": build(args, None), method: build(args, speculative)}
    results = {}
    for name, conversations in workloads().items():
        best = {engine: 0.0 for engine in engines}
        round_speedups = []
        cpu_tokens = {engine: 0 for engine in engines}
        cpu_seconds = {engine: 0.0 for engine in engines}
        texts: dict[str, list[str]] = {engine: [] for engine in engines}
        before = engines[method].llm_engine.stats.totals
        counts_before = (
            before.spec_num_drafts,
            before.spec_num_draft_tokens,
            before.spec_num_accepted_tokens,
        )
        for _ in range(args.repeats):
            tokens = {engine: 0 for engine in engines}
            seconds = {engine: 0.0 for engine in engines}
            texts = {engine: [] for engine in engines}
            for conversation in conversations:
                for engine, llm in engines.items():
                    n, s, cpu, text = run_one(llm, conversation, args.max_tokens)
                    tokens[engine] += n
                    seconds[engine] += s
                    cpu_tokens[engine] += n
                    cpu_seconds[engine] += cpu
                    texts[engine].append(text)
            rates = {engine: tokens[engine] / seconds[engine] for engine in engines}
            for engine in engines:
                best[engine] = max(best[engine], rates[engine])
            round_speedups.append(round(rates[method] / rates["none"], 2))
        after = engines[method].llm_engine.stats.totals
        counts = (
            after.spec_num_drafts - counts_before[0],
            after.spec_num_draft_tokens - counts_before[1],
            after.spec_num_accepted_tokens - counts_before[2],
        )
        acceptance, mean_length = spec_decode_rates(*counts)
        results[name] = {
            "none_tok_s": round(best["none"], 1),
            "spec_tok_s": round(best[method], 1),
            "speedup": round(best[method] / best["none"], 2),
            "round_speedups": round_speedups,
            "cpu_speedup": round(
                cpu_tokens[method]
                / cpu_seconds[method]
                / (cpu_tokens["none"] / cpu_seconds["none"]),
                2,
            ),
            "acceptance_rate": round(acceptance, 3),
            "mean_accepted_length": round(mean_length, 2),
            "identical_answers": sum(
                a == b for a, b in zip(texts["none"], texts[method], strict=True)
            ),
            "answers": len(conversations),
        }
    if args.json:
        print(json.dumps({"config": speculative, "results": results}, indent=2))
        return
    print(f"target {args.model or 'default model'}, dtype {args.dtype}, quantization "
          f"{args.quantization}; speculative config: {json.dumps(speculative)}, "
          f"max_tokens {args.max_tokens}; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(
        f"| workload | none tok/s | {method} tok/s | speedup | acceptance | mean accepted length "
        "| identical | speedup per round | speedup in CPU time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['none_tok_s']} | {r['spec_tok_s']} | {r['speedup']}x | "
            f"{r['acceptance_rate']:.1%} | {r['mean_accepted_length']} | "
            f"{r['identical_answers']}/{r['answers']} | "
            f"{', '.join(f'{x}x' for x in r['round_speedups'])} | {r['cpu_speedup']}x |"
        )


if __name__ == "__main__":
    main()
