"""Greedy ngram speculation on kiln-x86 gives the tokens and logprobs of plain decoding, bit for
bit, in the default dtype (bf16) on two model threads with contexts past 256 tokens: there the
attention kernel splits a decode over its context, and it must split a verification's rows (1 + k
one-token decodes in one step) exactly as it splits the plain decode step at each position,
whatever the step holds. (On one thread, short contexts: tests/spec_decode.)

Each engine runs in its own process: a process pins its model threads once."""

import json

import pytest

from kiln.testing import run_python

pytestmark = [pytest.mark.plugin, pytest.mark.slow]

GENERATE = """
import json, sys
from kiln import LLM, SamplingParams

code = "def add(a, b):\\n    total = a + b\\n    print(total)\\n    return total\\n"
functions = "".join(f"def f{i}(x):\\n    return x * {i} + {i * 7}\\n\\n" for i in range(30))
prompts = [functions + code + "\\n# The same function again, unchanged:\\n",
           functions + "# Now list the functions above in order, with their constants:\\n"]
speculative = json.loads(sys.argv[1])
llm = LLM(kv_cache_memory=0.1, max_model_len=1024, max_num_seqs=8,
          plugin_config={"x86": {"num_threads": 2, "cpus": "none"}},
          speculative_config=speculative)
params = SamplingParams(temperature=0, max_tokens=96, logprobs=0, ignore_eos=True)
outputs = []
for out in llm.generate(prompts, params, use_tqdm=False):
    c = out.outputs[0]
    outputs.append([len(out.prompt_token_ids), list(c.token_ids),
                    [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]])
accepted = llm.llm_engine.stats.totals.spec_num_accepted_tokens
print(json.dumps({"outputs": outputs, "accepted": accepted}))
"""


def generate(speculative: dict | None) -> list:
    proc = run_python(["-c", GENERATE, json.dumps(speculative)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_speculation_on_two_threads_past_256_tokens_is_plain_decoding_bit_for_bit():
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    spec, plain = generate(ngram), generate(None)
    assert spec["accepted"] > 0
    assert all(prompt_len > 256 for prompt_len, _, _ in plain["outputs"])
    assert spec["outputs"] == plain["outputs"]
