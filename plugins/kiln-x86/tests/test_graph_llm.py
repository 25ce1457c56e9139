"""Greedy output through ``LLM(platform="x86")`` with decode buckets, traced (the default) or
compiled, equals the reference ``cpu`` platform's, in float32.

The model is a small random Llama (2 layers) with the default model's tokenizer, so prompts are
text and the compile stays small (seconds, then inductor's cache). Buckets (1, 2) with
``max_num_seqs=3``: one batch per bucket and one above the largest, which runs eagerly. Without
``--graph-capture-sizes`` a trace takes its default buckets.
"""

from __future__ import annotations

import json

import pytest

from kiln.model_executor.loader import get_loader, resolve_model_ref
from kiln.model_executor.loader.default_model import default_model_path
from kiln.testing import run_python
from kiln.testing.models import save_tiny_model
from kiln.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    model_ref = resolve_model_ref(default_model_path())
    tokenizer = load_tokenizer(get_loader(model_ref).tokenizer_source(model_ref)).hf_tokenizer
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_tok"),
        tokenizer=tokenizer,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaked logits: greedy ties are unlikely
        tie_word_embeddings=True,
    )


# Run in a fresh process per platform: a process selects its platform once.
GENERATE = """
import json, sys
from kiln import LLM, SamplingParams

folder, platform, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
prompts, plugin_config = json.loads(sys.argv[4]), json.loads(sys.argv[5])
llm = LLM(folder, platform=platform, graph_capture_sizes=sizes, dtype="float32",
          kv_cache_memory=0.05, max_model_len=256, max_num_seqs=3, plugin_config=plugin_config)
runner = llm.llm_engine.engine_core.executor.worker.model_runner
params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
result = {"wrapper": type(runner.runnable).__name__, "sizes": runner.graph_sizes, "outputs": {}}
for batch in (1, 2, 3):
    outs = []
    for out in llm.generate(prompts[:batch], params, use_tqdm=False):
        c = out.outputs[0]
        steps = zip(c.logprobs, c.token_ids, strict=True)
        outs.append([list(c.token_ids), [step[t].logprob for step, t in steps]])
    result["outputs"][batch] = outs
print(json.dumps(result))
"""


def _generate(folder: str, platform: str, sizes: list[int] | None, plugin_config=None) -> dict:
    args = [json.dumps(sizes), json.dumps(PROMPTS), json.dumps(plugin_config or {})]
    proc = run_python(["-c", GENERATE, folder, platform, *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cpu_reference(tiny_folder: str) -> dict:
    """The reference cpu platform's outputs (eager), once for every graph mode below: they do not
    depend on the mode x86 runs in."""
    cpu = _generate(tiny_folder, "cpu", None)
    assert cpu["wrapper"] == "EagerGraphWrapper" and cpu["sizes"] == []
    return cpu


@pytest.mark.slow
@pytest.mark.parametrize(
    ("graph", "sizes", "wrapper", "expected_sizes"),
    [
        ("inductor", [1, 2], "CompiledGraphWrapper", [1, 2]),
        ("trace", [1, 2], "TracedGraphWrapper", [1, 2]),
        ("trace", None, "TracedGraphWrapper", [1, 2]),  # the defaults, up to max_num_seqs=3
    ],
)
def test_graph_greedy_matches_cpu_platform(
    tiny_folder, cpu_reference, graph, sizes, wrapper, expected_sizes
):
    x86 = _generate(tiny_folder, "x86", sizes, {"x86": {"graph": graph}})
    assert x86["wrapper"] == wrapper and x86["sizes"] == expected_sizes
    for batch, reference in cpu_reference["outputs"].items():
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(
            x86["outputs"][batch], reference, strict=True
        ):
            assert tokens == ref_tokens
            assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
