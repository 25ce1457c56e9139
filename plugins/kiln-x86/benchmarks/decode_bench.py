"""Offline batch-1 decode speed of the default model under several ``x86`` config sections.

``--set kernels`` (default): exact GGUF kernels against int8 activations; ``--set helpers``:
one model thread, one model thread with a matmul helper thread (``helper_threads``), and two
OpenMP model threads.

Each configuration runs in its own fresh process (the platform and its kernels are chosen once
per process), alternating, ``--rounds`` times: ``LLM.generate`` of one 64-token prompt with
``--output-len`` greedy tokens (EOS ignored), and of the same prompt with 1 token; the difference
over ``output-len - 1`` is one decode step (wall time, or with ``--clock cpu`` the process's CPU
time, steadier on a shared machine). Prints the best round's decode tokens/s per configuration
and the load average.

    python plugins/kiln-x86/benchmarks/decode_bench.py [--set helpers] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIG_SETS = {
    "kernels": {  # both named: int8 activations are the default now
        "exact (float kernel)": {"int8_activations": False},
        "int8 activations (tiled)": {"int8_activations": True},
    },
    "helpers": {
        "1 thread": {"num_threads": 1},
        "1 thread + 1 helper": {"num_threads": 1, "helper_threads": 1},
        "2 threads": {"num_threads": 2},
    },
}

_CHILD = """
import json, sys, time
from kiln import LLM, SamplingParams
section, threads, output_len = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(kv_cache_memory=0.25, enable_prefix_caching=False,
          plugin_config={"x86": {"num_threads": threads, **section}})
prompt = {"prompt_token_ids": [1000 + 37 * i % 40000 for i in range(64)]}
clock = time.perf_counter if sys.argv[4] == "wall" else time.process_time
def run(n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = clock()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return clock() - start, out.outputs[0].token_ids
run(8)  # warm-up
best = float("inf")
for _ in range(2):
    full, tokens = run(output_len)
    first, _ = run(1)
    best = min(best, (full - first) / (output_len - 1))
print(json.dumps({"step_s": best, "tokens": list(tokens)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=sorted(CONFIG_SETS), default="kernels")
    parser.add_argument("--threads", type=int, default=1, help="model threads unless the set says")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=65)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (steadier on a shared machine; all its threads)",
    )
    args = parser.parse_args()
    print(f"load={os.getloadavg()[0]:.1f}")
    configs = CONFIG_SETS[args.set]
    best = dict.fromkeys(configs, float("inf"))
    tokens = {}
    for _ in range(args.rounds):
        for name, section in configs.items():
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, json.dumps(section)]
                + [str(args.threads), str(args.output_len), args.clock],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            best[name] = min(best[name], result["step_s"])
            tokens[name] = result["tokens"]
            print(f"{name}: {1 / result['step_s']:.1f} tok/s", flush=True)
    print(f"threads={args.threads} clock={args.clock} load={os.getloadavg()[0]:.1f}")
    for name, step in best.items():
        print(f"| {name} | {step * 1e3:.1f} ms | {1 / step:.1f} tok/s |")
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"greedy tokens identical across configurations: {same}")


if __name__ == "__main__":
    main()
