"""An architecture Kiln has no class for (Starcoder2), served by transformers' modeling code on
Kiln's attention (``--model-impl auto``) on kiln-x86: its linear layers are Kiln's, so kiln-x86's
linear methods run them, dense in bfloat16 (traced with the decode graphs) and quantized with
``--quantization int8``; each agrees with float32's greedy choices, teacher-forced, where
float32's top two are clear (a small random model from ``save_tiny_model``)."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.model_executor.loader.default_model import default_model_path
from kiln.testing.checks import _teacher_forced
from kiln.testing.models import save_tiny_model

PROMPTS = [
    [1, 5, 9, 200, 17],
    [3, 250, 7, 44, 12, 99, 8, 140, 61],
    [(11 * i) % 251 for i in range(1, 41)],
]
NUM_TOKENS = 24
TIE_MARGIN = 0.25


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_model(
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


def _llm(folder: str, **options) -> LLM:
    return LLM(
        folder, tokenizer=default_model_path(), kv_cache_memory=0.02, max_model_len=256, **options
    )


@pytest.fixture(scope="module")
def float32_run(folder):
    """float32's greedy completions and, per position, the margin of its top two logprobs."""
    llm = _llm(folder, dtype="float32")
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, logprobs=2, ignore_eos=True, detokenize=False
    )
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    completions = [o.outputs[0].token_ids for o in outputs]
    margins = []
    for output in outputs:
        for position in output.outputs[0].logprobs or []:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            margins.append(top[0] - top[1])
    return completions, margins


@pytest.mark.parametrize(
    ("options", "method", "min_agreement"),
    [
        ({"dtype": "bfloat16"}, "Unquantized", 0.99),
        ({"dtype": "float32", "quantization": "int8"}, "Int8", 0.95),
    ],
    ids=["bfloat16", "int8"],
)
def test_kiln_x86_runs_transformers_linears(folder, float32_run, options, method, min_agreement):
    completions, margins = float32_run
    llm = _llm(folder, **options)
    try:
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        methods = {
            name: type(module.quant_method).__name__
            for name, module in model.named_modules()
            if hasattr(module, "quant_method")
        }
        assert "model.layers.0.self_attn.q_proj" in methods and "lm_head" not in methods
        assert all(method in m for m in methods.values()), methods
        if "quantization" not in options:
            assert next(model.parameters()).dtype == torch.bfloat16
        forced = _teacher_forced(llm, PROMPTS, completions)
    finally:
        llm.llm_engine.shutdown()
    tops = [row[0] for rows in forced for row in rows]
    tokens = [token for completion in completions for token in completion]
    clear = [(t, g) for t, g, m in zip(tops, tokens, margins, strict=True) if m > TIE_MARGIN]
    assert len(clear) >= 0.6 * len(tokens), f"{len(clear)} of {len(tokens)} positions clear"
    agreement = sum(t == g for t, g in clear) / len(clear)
    assert agreement >= min_agreement, f"top-1 agreement {agreement:.4f} of {len(clear)}"
