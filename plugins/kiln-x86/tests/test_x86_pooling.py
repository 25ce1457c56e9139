"""``LLM(runner="pooling")`` on kiln-x86 with decode graphs (traced, the default wrapper) equals
the reference ``cpu`` platform's embeddings, float32: steps that fit a graph bucket (buckets 1
and 4: an input of one token, and one of three padded to four) replay the graph, whose padded
hidden states the pooling stage reads only up to the step's real tokens; longer inputs (chunked
over a small budget) run eagerly.

A small random Llama (2 layers), token-id inputs; each platform in a fresh process (a process
selects its platform once).
"""

from __future__ import annotations

import json

import pytest

from kiln.testing import run_python
from kiln.testing.models import save_tiny_model

INPUTS = [[5], [7, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(10, 60))]

EMBED = """
import json, sys
from kiln import LLM

folder, platform, pooling_type = sys.argv[1], sys.argv[2], sys.argv[3]
sizes, inputs = json.loads(sys.argv[4]), json.loads(sys.argv[5])
llm = LLM(folder, tokenizer=sys.argv[6], platform=platform, runner="pooling",
          pooler_config={"pooling_type": pooling_type}, graph_capture_sizes=sizes,
          dtype="float32", kv_cache_memory=0.05, max_model_len=256, max_num_seqs=4,
          max_num_batched_tokens=16)
runner = llm.llm_engine.engine_core.executor.worker.model_runner
alone = [llm.embed([ids], use_tqdm=False)[0].outputs.embedding for ids in inputs]
batched = [out.outputs.embedding for out in llm.embed(inputs, use_tqdm=False)]
print(json.dumps({"wrapper": type(runner.runnable).__name__, "sizes": runner.graph_sizes,
                  "alone": alone, "batched": batched}))
"""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_pooling"), hidden_size=64, seed=5)


def _embed(folder: str, gguf: str, platform: str, pooling_type: str, sizes) -> dict:
    args = [folder, platform, pooling_type, json.dumps(sizes), json.dumps(INPUTS), gguf]
    proc = run_python(["-c", EMBED, *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_x86_pooling_with_graphs_matches_cpu_platform(tiny_folder, gguf_path, pooling_type):
    x86 = _embed(tiny_folder, gguf_path, "x86", pooling_type, [1, 4])
    cpu = _embed(tiny_folder, gguf_path, "cpu", pooling_type, None)
    assert x86["wrapper"] == "TracedGraphWrapper" and x86["sizes"] == [1, 4]
    for name in ("alone", "batched"):
        for got, want in zip(x86[name], cpu["alone"], strict=True):
            assert got == pytest.approx(want, abs=1e-5)
