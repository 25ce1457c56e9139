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
from test_model_families import (
    COMMON,
    FAMILIES,
    PROMPTS,
    check_bf16_agrees_with_float32,
    check_served_against_transformers,
)
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from kiln import LLM
from kiln.model_executor.models.gemma2 import Gemma2ForCausalLM
from kiln.model_executor.models.gemma3 import Gemma3ForCausalLM
from kiln.testing.models import save_tiny_model

NUM_TOKENS = 32


def _save(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    config = dict(FAMILIES[family])
    model_type = config.pop("model_type")
    folder = tmp_path_factory.mktemp(family)
    return save_tiny_model(folder, model_type, random_norms=True, **{**COMMON, **config})


def _llm(folder: str, tokenizer: str, dtype: str) -> LLM:
    return LLM(folder, tokenizer=tokenizer, dtype=dtype, kv_cache_memory=0.02, max_model_len=256)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_bfloat16_agrees_with_float32(tmp_path_factory, gguf_path, family) -> None:
    """See ``check_bf16_agrees_with_float32``."""
    check_bf16_agrees_with_float32(_save(tmp_path_factory, family), gguf_path, family)


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
