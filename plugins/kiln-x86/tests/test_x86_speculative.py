"""Greedy ngram speculation on kiln-x86 gives the tokens and logprobs of plain decoding, bit for
bit, in the default dtype (bf16) on two model threads with contexts past 256 tokens: there the
attention kernel splits a decode over its context, and it must split a verification's rows (1 + k
one-token decodes in one step) exactly as it splits the plain decode step at each position,
whatever the step holds. On one thread with short contexts too, asked twice: the second time
each prompt hits the prefix cache and computes only its last 1..16 tokens, a verification's row
count, which must keep the bits the whole prompt's prefill gave them (as decodes, a near-tie
first token of a repeated chat question flipped). Kiln's reference cpu platform promises the
same tokens only up to the numerics of computing several positions at once (README).

Each engine runs in its own process: a process pins its model threads once."""

import json

import pytest

from kiln.testing import run_python

pytestmark = [pytest.mark.plugin, pytest.mark.slow]

GENERATE = """
import json, sys
from kiln import LLM, SamplingParams

speculative, x86, prompts, max_tokens, repeat = map(json.loads, sys.argv[1:6])
llm = LLM(kv_cache_memory=0.1, max_model_len=1024, max_num_seqs=8, plugin_config={"x86": x86},
          speculative_config=speculative)
params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)

def generate():
    outputs = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        outputs.append([len(out.prompt_token_ids), list(c.token_ids),
                        [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]])
    return outputs

outputs = generate()
hits = llm.llm_engine.stats.totals.prefix_cache_hits
again = generate() if repeat else None  # each prompt's full blocks from the prefix cache
totals = llm.llm_engine.stats.totals
print(json.dumps({"outputs": outputs, "again": again, "accepted": totals.spec_num_accepted_tokens,
                  "again_hits": totals.prefix_cache_hits - hits,
                  "block_size": llm.llm_engine.config.cache.block_size}))
"""

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    total = a + b\n    print(total)\n    return total\n"
FUNCTIONS = "".join(f"def f{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(30))
LONG_PROMPTS = [
    FUNCTIONS + CODE + "\n# The same function again, unchanged:\n",
    FUNCTIONS + "# Now list the functions above in order, with their constants:\n",
]
SHORT_PROMPTS = [  # tests/spec_decode/test_speculative_llm.py's
    f"{CODE}\n# The same function again, unchanged:\n",
    "Copy this list: red, green, blue, yellow, purple, orange. Copy: red, green, blue,",
    "The capital of France is",  # little to look up: few or no drafts
    f"{CODE}\n# Now with the name changed to plus:\ndef plus(a, b):\n",
]


def generate(
    speculative: dict | None, x86: dict, prompts: list[str], max_tokens: int, repeat: bool = False
) -> dict:
    """Greedy outputs of ``prompts`` in a fresh process; with ``repeat``, asked again after."""
    args = [json.dumps(a) for a in (speculative, x86, prompts, max_tokens, repeat)]
    proc = run_python(["-c", GENERATE, *args], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_greedy_speculation_on_two_threads_past_256_tokens_is_plain_decoding_bit_for_bit():
    x86 = {"num_threads": 2, "cpus": "none"}
    spec, plain = (generate(s, x86, LONG_PROMPTS, 96) for s in (NGRAM, None))
    assert spec["accepted"] > 0
    assert all(prompt_len > 256 for prompt_len, _, _ in plain["outputs"])
    assert spec["outputs"] == plain["outputs"]


def test_greedy_speculation_on_one_thread_is_plain_decoding_bit_for_bit_also_from_the_cache():
    x86 = {"num_threads": 1}
    spec = generate(NGRAM, x86, SHORT_PROMPTS, 64, repeat=True)
    plain = generate(None, x86, SHORT_PROMPTS, 64)
    assert spec["accepted"] > 0
    assert spec["outputs"] == plain["outputs"]
    # Asked again, each prompt computes only what follows its full blocks: more than one row.
    block = spec["block_size"]
    tails = [n - (n - 1) // block * block for n, _, _ in spec["outputs"]]
    assert any(tail > 1 for tail in tails), tails
    assert spec["again_hits"] > 0
    assert spec["again"] == spec["outputs"]
