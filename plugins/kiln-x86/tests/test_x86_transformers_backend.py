"""An architecture Kiln has no class for (Starcoder2), served by transformers' modeling code on
Kiln's attention (``--model-impl auto``) on kiln-x86: its linear layers are Kiln's, so kiln-x86's
linear methods run them, dense in bfloat16 (traced with the decode graphs) and quantized with
``--quantization int8``; each agrees with float32's greedy choices, teacher-forced, where
float32's top two are clear (a small random model from ``save_tiny_model``). The runs happen in
a fresh process that selects kiln-x86 (a pytest process keeps the first platform it selected)."""

from __future__ import annotations

import json

import pytest

from kiln.testing import run_python
from kiln.testing.models import save_tiny_model

RUNS = """
import json, sys
from kiln import LLM, SamplingParams
from kiln.testing.checks import _teacher_forced

folder, tokenizer = sys.argv[1], sys.argv[2]
prompts = [[1, 5, 9, 200, 17], [3, 250, 7, 44, 12, 99, 8, 140, 61]]
prompts.append([(11 * i) % 251 for i in range(1, 41)])
def llm(**options):
    return LLM(folder, tokenizer=tokenizer, platform="x86", kv_cache_memory=0.02,
               max_model_len=256, **options)
f32 = llm(dtype="float32")
params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True, detokenize=False)
outputs = f32.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
f32.llm_engine.shutdown()
completions = [o.outputs[0].token_ids for o in outputs]
margins = []
for output in outputs:
    for position in output.outputs[0].logprobs:
        top = sorted((lp.logprob for lp in position.values()), reverse=True)
        margins.append(top[0] - top[1])
result = {"tokens": [t for c in completions for t in c], "margins": margins}
for label, options in (("bfloat16", {"dtype": "bfloat16"}),
                       ("int8", {"dtype": "float32", "quantization": "int8"})):
    run = llm(**options)
    runner = run.llm_engine.engine_core.executor.worker.model_runner
    methods = {name: type(m.quant_method).__name__ for name, m in runner.model.named_modules()
               if hasattr(m, "quant_method")}
    forced = _teacher_forced(run, prompts, completions)
    run.llm_engine.shutdown()
    result[label] = {
        "methods": methods,
        "dtype": str(next(runner.model.parameters()).dtype),
        "traced": sorted(getattr(runner.runnable, "_graphs", {})),
        "tops": [row[0] for rows in forced for row in rows],
    }
print(json.dumps(result))
"""
TIE_MARGIN = 0.25


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gguf_path) -> dict:
    folder = save_tiny_model(
        tmp_path_factory.mktemp("starcoder2"),
        "starcoder2",
        random_norms=True,
        vocab_size=251,
        initializer_range=0.2,
        sliding_window=6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    proc = run_python(["-c", RUNS, folder, gguf_path], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("label", "method", "min_agreement"),
    [("bfloat16", "Unquantized", 0.99), ("int8", "Int8", 0.95)],
)
def test_kiln_x86_runs_transformers_linears(runs, label, method, min_agreement) -> None:
    run = runs[label]
    methods = run["methods"]
    assert "model.layers.0.self_attn.q_proj" in methods and "lm_head" not in methods
    assert all(method in m for m in methods.values()), methods
    assert run["traced"], "no decode graph was traced"
    if label == "bfloat16":
        assert run["dtype"] == "torch.bfloat16"
    clear = [
        (top, token)
        for top, token, margin in zip(run["tops"], runs["tokens"], runs["margins"], strict=True)
        if margin > TIE_MARGIN
    ]
    assert len(clear) >= 0.6 * len(runs["tokens"]), f"{len(clear)} positions clear"
    agreement = sum(t == g for t, g in clear) / len(clear)
    assert agreement >= min_agreement, f"top-1 agreement {agreement:.4f} of {len(clear)}"
