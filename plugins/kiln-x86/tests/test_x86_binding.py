"""Pinning in real processes: each model thread on its own core, the offline caller kept on the
model's whole set, and ``kiln serve``'s API server moved to its reserved cores before it starts
the engine (which still sees every usable core)."""

import json
import os

import pytest
from kiln_x86.options import parse_cpu_list

from kiln.testing import run_python

pytestmark = pytest.mark.plugin

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores")

PIN_AND_REPORT = """
import json, os, threading, torch
from kiln_x86.binding import pin_model_threads, thread_affinities
cpus = tuple(json.loads(os.environ["CPUS"]))
pin_model_threads(cpus, pin_caller=os.environ["PIN_CALLER"] == "1")
x = torch.randn(512, 512)
for _ in range(3):
    x @ x  # a parallel op runs on the pinned pool
print(json.dumps({"main": thread_affinities()[threading.get_native_id()],
                  "all": list(thread_affinities().values()),
                  "threads": torch.get_num_threads()}))
"""


def _pin(cpus, pin_caller):
    env = {"CPUS": json.dumps(cpus), "PIN_CALLER": "1" if pin_caller else "0"}
    proc = run_python(["-c", PIN_AND_REPORT], env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@needs_two
def test_each_model_thread_is_pinned_to_its_own_core():
    cpus = CORES[:2]
    result = _pin(cpus, pin_caller=True)
    assert result["threads"] == 2
    assert result["main"] == [cpus[0]]
    # The other pool thread sits alone on the second core.
    assert [cpus[1]] in result["all"]


@needs_two
def test_an_offline_caller_keeps_the_whole_set():
    cpus = CORES[:2]
    result = _pin(cpus, pin_caller=False)
    assert result["main"] == cpus
    assert [cpus[1]] in result["all"]


API_PROCESS = """
import json, os
from kiln.config import KilnConfig, PluginConfig
from kiln.plugins import init_process
init_process("api", KilnConfig(plugins=PluginConfig(sections={"x86": {"reserved_cpus": 1}})))
print(json.dumps({"api": sorted(os.sched_getaffinity(0)),
                  "usable": os.environ.get("KILN_X86_USABLE_CPUS")}))
"""


@needs_two
def test_the_api_server_moves_to_its_reserved_core_and_tells_the_engine_what_was_usable():
    proc = run_python(["-c", API_PROCESS], {"KILN_X86_USABLE_CPUS": ""})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["api"] == [CORES[0]]
    assert parse_cpu_list(result["usable"]) == CORES


HELPERS_OFFLINE = """
import json, sys
from kiln import LLM, SamplingParams
from kiln_x86 import gemv
from kiln_x86.binding import thread_affinities
helpers = int(sys.argv[1])
llm = LLM(plugin_config={"x86": {"helper_threads": helpers}}, graph_capture_sizes="",
          max_model_len=256, kv_cache_memory=0.05)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = ["The capital of France is", "Write a haiku about the sea."]
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps({"tokens": tokens, "helpers": gemv.load_gemv_kernels().pool_helpers(),
                  "affinities": list(thread_affinities().values())}))
"""


@needs_two
@pytest.mark.slow
def test_matmul_helper_threads_in_an_engine_keep_greedy_output():
    """``x86.helper_threads=1`` in a real offline engine on the default model: one helper, alone
    on the core the model's thread leaves, and the same greedy tokens as without it (a row's
    result does not depend on who computed its tiles)."""
    results = {}
    for helpers in (0, 1):
        proc = run_python(["-c", HELPERS_OFFLINE, str(helpers)])
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[helpers] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results[0]["helpers"] == 0 and results[1]["helpers"] == 1
    assert [CORES[1]] in results[1]["affinities"]
    assert results[1]["tokens"] == results[0]["tokens"]
