"""``kiln bench serve`` against ``kiln serve`` on the reference cpu platform and on x86 with each
thread layout, in one run: what pinning and thread count do, and what the defaults should be.

Each configuration in turn starts ``kiln serve`` alone on a free loopback port, runs
``kiln bench serve`` at concurrency 1 (``--c1-prompts`` requests of 64 prompt tokens) and 16
(``--c16-prompts`` requests of 128), 128 output tokens each with ``ignore_eos``, and stops it;
``--rounds`` repeats the whole sequence, interleaved, so that load from elsewhere on the machine
hits every configuration alike. Prints output tokens/s and median TTFT/TPOT per configuration
and round.

    python plugins/kiln-x86/benchmarks/binding_bench.py [--rounds 2] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from serve_compare import free_port, stop, wait_healthy  # noqa: E402

KILN = [sys.executable, "-m", "kiln.entrypoints.cli"]

CONFIGS: dict[str, list[str]] = {
    "cpu (default: 1 thread)": ["--platform", "cpu"],
    "cpu, 2 threads": ["--platform", "cpu", "--plugin-config", '{"cpu": {"num_threads": 2}}'],
    "x86, 2 threads unpinned": ["--plugin-config", '{"x86": {"cpus": "none", "num_threads": 2}}'],
    "x86, 2 threads pinned (default)": [],
    "x86, 1 pinned + API core": ["--plugin-config", '{"x86": {"reserved_cpus": 1}}'],
}
WORKLOADS = {1: (64, "c1_prompts"), 16: (128, "c16_prompts")}
"""Concurrency -> (prompt tokens, the option holding the number of requests)."""


def bench(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    input_len, prompts_opt = WORKLOADS[concurrency]
    num_prompts = getattr(args, prompts_opt)
    command = [
        *KILN,
        "bench",
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        str(input_len),
        "--output-len",
        "128",
        "--max-concurrency",
        str(concurrency),
        "--json",
        "--disable-tqdm",
    ]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=1800)
    return json.loads(done.stdout)


def run_config(name: str, flags: list[str], args: argparse.Namespace, log_dir: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(log_dir, name.replace(" ", "_").replace(",", "") + ".log")
    command = [*KILN, "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    try:
        wait_healthy(url, process, log_path)
        out = {}
        for concurrency in WORKLOADS:
            r = bench(url, concurrency, args)
            out[concurrency] = {
                "output_tok_s": r["output_throughput"],
                "median_ttft_ms": r["median_ttft_ms"],
                "median_tpot_ms": r["median_tpot_ms"],
                "failed": r["failed"],
                "load_average_after": os.getloadavg()[0],
            }
            print(f"  {name:34} c={concurrency:<3} {out[concurrency]}", flush=True)
        return out
    finally:
        stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--c1-prompts", type=int, default=8)
    parser.add_argument("--c16-prompts", type=int, default=64)
    parser.add_argument("--configs", default=None, help="comma-separated subset of names")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    names = args.configs.split(",") if args.configs else list(CONFIGS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as log_dir:
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}", flush=True)
            for name in names:
                results[name].append(run_config(name, CONFIGS[name], args, log_dir))
    print("\n| configuration | round | c=1 tok/s | c=1 TPOT ms | c=16 tok/s | c=16 TTFT ms |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        for i, r in enumerate(rounds):
            print(
                f"| {name} | {i + 1} | {r[1]['output_tok_s']:.1f} | {r[1]['median_tpot_ms']:.1f} "
                f"| {r[16]['output_tok_s']:.1f} | {r[16]['median_ttft_ms']:.0f} |"
            )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
