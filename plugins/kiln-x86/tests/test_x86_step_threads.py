"""The x86 worker's thread count per step (``kiln_x86.worker``), in real engines on the default
model: a step of at least ``x86.min_prefill_tokens`` tokens runs on ``num_prefill_threads``
threads, seen from inside the model's forward (a PyTorch forward pre-hook); the pool's second
thread stays pinned to its core; and the switch changes no result bit (prompt logprobs, computed
in the prefill step, and the sampled tokens' logprobs against an engine that never switches)."""

import json
import os

import pytest

from kiln.testing import run_python

pytestmark = pytest.mark.plugin

CORES = sorted(os.sched_getaffinity(0))

GENERATE = """
import json, os, sys, threading
import torch
from kiln import LLM, SamplingParams
from kiln_x86.binding import thread_affinities

# No decode graphs: a replayed graph runs no module hook, and the hook below sees every step.
llm = LLM(max_num_seqs=4, kv_cache_memory=0.1, max_model_len=512, enable_prefix_caching=False,
          graph_capture_sizes="", plugin_config={"x86": json.loads(sys.argv[1])})
runner = llm.llm_engine.engine_core.executor.worker.model_runner
steps = []

def note_threads(module, args):
    others = [cpus for tid, cpus in thread_affinities().items() if tid != threading.get_native_id()]
    steps.append([len(args[0]), torch.get_num_threads(), others])

runner.model.register_forward_pre_hook(note_threads)
prompts = json.loads(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, prompt_logprobs=0,
                        ignore_eos=True)
outputs = []
for out in llm.generate(prompts, params, use_tqdm=False):
    c = out.outputs[0]
    prompt_lps = [None if lp is None else lp[t].logprob
                  for lp, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
    outputs.append([list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    prompt_lps])
print(json.dumps({"steps": steps, "outputs": outputs}))
"""

# Two prompts: 150 + 120 = 270 tokens in the prefill step, then 2-row decode steps.
PROMPTS = [
    [(7 * i) % 40000 + 1000 for i in range(150)],
    [(11 * i) % 40000 + 1000 for i in range(120)],
]


def generate(x86: dict) -> dict:
    proc = run_python(["-c", GENERATE, json.dumps(x86), json.dumps(PROMPTS)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores")
def test_prefill_steps_run_on_more_threads_with_the_same_results():
    switching = generate({"num_threads": 1, "num_prefill_threads": 2, "min_prefill_tokens": 200})
    prefill, *decodes = switching["steps"]
    assert prefill[:2] == [270, 2]
    assert [CORES[1]] in prefill[2]  # the pool's second thread, on its own core
    assert decodes and all(step[:2] == [2, 1] for step in decodes)

    steady = generate({"num_threads": 1, "num_prefill_threads": 1})
    assert steady["steps"][0][:2] == [270, 1]
    # Bit for bit: json carries every float's exact value.
    assert switching["outputs"] == steady["outputs"]
