"""Perplexity over a fixed text, for any engine config (``kiln.bench.perplexity``).

The text defaults to CPython's ``LICENSE.txt`` (shipped with every CPython, about 3,000 tokens);
each config is a set of ``LLM`` keywords, run in its own process (a process selects its platform
once). With no ``--config`` it scores the dequantized float32 reference (``--platform cpu``,
``dtype=float32``) and the default model as the selected platform runs it (``quantization=auto``:
kept quantized where the platform supports it), and prints how far apart they are.

    .venv/bin/python benchmarks/perplexity.py [--model PATH] [--text PATH] [--window 1024]
        [--config '{"quantization": "int8", "dtype": "bfloat16"}' ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from kiln.bench.perplexity import DEFAULT_TEXT, DEFAULT_WINDOW, perplexity, read_text

DEFAULT_CONFIGS = [
    {"platform": "cpu", "dtype": "float32", "quantization": "none"},
    {"quantization": "auto"},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the text file to score")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per prompt")
    parser.add_argument(
        "--config", action="append", default=None, metavar="JSON", help="LLM keywords (repeat)"
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's config
    args = parser.parse_args()
    if args.one is not None:
        score_one(json.loads(args.one), args)
        return
    configs = [json.loads(c) for c in args.config] if args.config else DEFAULT_CONFIGS
    results = []
    for config in configs:
        child = [sys.executable, __file__, "--one", json.dumps(config), "--text", args.text]
        child += ["--window", str(args.window)] + (["--model", args.model] if args.model else [])
        line = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
        result = json.loads(line.strip().splitlines()[-1])
        results.append(result["perplexity"])
        print(
            f"{json.dumps(config)} on platform {result['platform']}: perplexity "
            f"{result['perplexity']:.4f} over {result['tokens']} tokens "
            f"({result['seconds']:.0f} s)",
            flush=True,
        )
    print(f"text: {args.text}")
    if len(results) > 1:
        diffs = [f"{r / results[0] - 1:+.3%}" for r in results]
        print(f"relative difference to the first: {diffs}")


def score_one(config: dict, args: argparse.Namespace) -> None:
    from kiln import LLM

    start = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory=0.5, **config)
    from kiln.platforms import current_platform  # after LLM(): importing it selects a platform

    token_ids = llm.get_tokenizer().encode(read_text(args.text))
    ppl, count = perplexity(llm, token_ids, args.window)
    seconds = time.perf_counter() - start
    result = {"perplexity": ppl, "tokens": count, "seconds": seconds}
    print(json.dumps({**result, "platform": current_platform.name}))


if __name__ == "__main__":
    main()
