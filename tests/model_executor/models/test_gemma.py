"""Gemma 2 and Gemma 3 beyond the family check of test_model_families (which compares both with
``transformers`` in float32): the same small random models in bfloat16 agree with float32,
Gemma 2 served by ``kiln serve`` to the official ``openai`` client gives transformers' tokens and
logprobs, and the config forms of released checkpoints (no ``layer_types``, old rope keys) and
what Kiln refuses parse as documented.

The models are test_model_families' (``FAMILIES``): vocabulary 251, two layers (one sliding with
a window of 8, one global), four query heads over two KV heads, ``head_dim`` 48, random norms.
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import COMMON, FAMILIES, PROMPTS, check_served_against_transformers
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from kiln import LLM, SamplingParams
from kiln.model_executor.models.gemma2 import Gemma2ForCausalLM
from kiln.model_executor.models.gemma3 import Gemma3ForCausalLM
from kiln.testing.checks import _teacher_forced
from kiln.testing.models import save_tiny_model

NUM_TOKENS = 32
MIN_TOP1_AGREEMENT = 0.99
TIE_MARGIN = 0.25
"""Nats between float32's top two logprobs under which bfloat16 may pick either: transformers'
own bfloat16 flips a position of Gemma 3's model below whose top two are 0.19 apart."""


def _save(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    config = dict(FAMILIES[family])
    model_type = config.pop("model_type")
    folder = tmp_path_factory.mktemp(family)
    return save_tiny_model(folder, model_type, random_norms=True, **{**COMMON, **config})


def _llm(folder: str, tokenizer: str, dtype: str) -> LLM:
    return LLM(folder, tokenizer=tokenizer, dtype=dtype, kv_cache_memory=0.02, max_model_len=256)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_bfloat16_agrees_with_float32(tmp_path_factory, gguf_path, family) -> None:
    """Teacher-forced on float32's greedy completions: bfloat16's most likely token is float32's
    at >= 99% of the positions where float32's top two differ by more than ``TIE_MARGIN``.

    NOTE: these tiny random models have near-ties that bfloat16's rounding flips whoever computes
    it: transformers' own bfloat16 agrees with its float32 at 0.95-0.98 of all positions here, so
    positions closer than ``TIE_MARGIN`` are left out (at most 40%, checked below)."""
    folder = _save(tmp_path_factory, family)
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, logprobs=2, ignore_eos=True, detokenize=False
    )
    llm = _llm(folder, gguf_path, "float32")
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
    llm = _llm(folder, gguf_path, "bfloat16")
    try:
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        assert next(model.parameters()).dtype == torch.bfloat16
        forced = _teacher_forced(llm, PROMPTS, completions)
    finally:
        llm.llm_engine.shutdown()
    tops = [row[0] for rows in forced for row in rows]
    tokens = [token for completion in completions for token in completion]
    assert len(tops) == len(tokens) == len(margins) == len(PROMPTS) * NUM_TOKENS
    clear = [(t, g) for t, g, m in zip(tops, tokens, margins, strict=True) if m > TIE_MARGIN]
    assert len(clear) >= 0.6 * len(tokens), f"{len(clear)} of {len(tokens)} positions clear"
    agreement = sum(t == g for t, g in clear) / len(clear)
    assert agreement >= MIN_TOP1_AGREEMENT, f"top-1 agreement {agreement:.4f} of {len(clear)}"
    print(f"{family}: bf16 top-1 agreement {agreement:.4f} on {len(clear)} of {len(tokens)}")


@pytest.mark.slow
def test_gemma2_through_kiln_serve_and_the_openai_client(tmp_path_factory, gguf_path, hf_ref):
    folder = _save(tmp_path_factory, "gemma2")
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    check_served_against_transformers(folder, hf_model, gguf_path, hf_ref, PROMPTS)


def test_gemma2_without_layer_types_slides_on_even_layers() -> None:
    config = Gemma2Config(num_hidden_layers=5, sliding_window=16).to_dict()
    del config["layer_types"]
    args = Gemma2ForCausalLM.parse_config(config)
    assert args.sliding_windows == (16, None, 16, None, 16)
    assert args.attn_logit_softcap == 50.0 and args.final_logit_softcap == 30.0
    assert args.attention_scale == 256**-0.5 and args.tie_word_embeddings


def test_gemma3_released_config_form() -> None:
    # As on the Hub before transformers 5: rope_theta / rope_scaling / rope_local_base_freq and
    # sliding_window_pattern, no layer_types.
    config = {
        **Gemma3TextConfig(num_hidden_layers=7).to_dict(),
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 3,
    }
    del config["rope_parameters"], config["layer_types"]
    args = Gemma3ForCausalLM.parse_config(config)
    assert args.sliding_windows == (512, 512, None, 512, 512, None, 512)
    assert args.rope_theta == 1_000_000.0 and args.local_rope_theta == 10_000.0
    assert args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert args.attn_logit_softcap is None and args.final_logit_softcap is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_gemma_refuses_what_it_does_not_implement(change, field) -> None:
    for cls, config in (
        (Gemma2ForCausalLM, Gemma2Config()),
        (Gemma3ForCausalLM, Gemma3TextConfig()),
    ):
        with pytest.raises(ValueError, match=field):
            cls.parse_config({**config.to_dict(), **change})


def test_gemma3_refuses_scaling_on_the_local_rotary_embedding() -> None:
    config = Gemma3TextConfig().to_dict()
    config["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="sliding_attention"):
        Gemma3ForCausalLM.parse_config(config)
