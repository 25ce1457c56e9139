"""Architectures Kiln has no class for, served by transformers' modeling code on Kiln's paged
attention (``--model-impl auto|transformers``), against transformers itself.

Each is a small random model made by ``transformers`` from a seeded config (``save_tiny_model``,
random norms and biases, a vocabulary of 251) with what is particular to it switched on:
GPT-NeoX's partial rotary and parallel residual over full multi-head attention, Starcoder2's
sliding window (6, shorter than every sequence) over grouped KV heads, Cohere's logit scale
(applied by the causal LM's head code, which Kiln runs on its selected rows) and GPT-2's learned
absolute positions (which come from Kiln's positions). Kiln must give transformers' 32 greedy
tokens and logprobs within 1e-4 in float32 on the process's platform (kiln-x86 with its decode
graphs where installed). Llama, which Kiln has a class for, runs through transformers too when
asked. A bfloat16 run of each agrees with float32 (top-1, teacher-forced, as the native
families'). One architecture is served by ``kiln serve`` to the official client.
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import (
    COMMON,
    PROMPTS,
    check_against_transformers,
    check_bf16_agrees_with_float32,
    check_served_against_transformers,
)
from transformers import AutoModelForCausalLM

from kiln import LLM
from kiln.config import ModelConfig
from kiln.model_executor.registry import describe_model_impl, model_impl_of
from kiln.testing.models import save_tiny_model

ARCHITECTURES = {
    "gpt_neox": dict(num_key_value_heads=None, rotary_pct=0.5, use_parallel_residual=True),
    "starcoder2": dict(sliding_window=6),
    "cohere": dict(logit_scale=2.0),
    "gpt2": dict(num_key_value_heads=None, n_positions=256),
    "llama": dict(),  # native in Kiln: run through transformers by model_impl="transformers"
}


def _save(tmp_path_factory: pytest.TempPathFactory, model_type: str) -> str:
    return save_tiny_model(
        tmp_path_factory.mktemp(model_type),
        model_type,
        random_norms=True,
        **{**COMMON, **ARCHITECTURES[model_type]},
    )


def _hf(folder: str):
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_greedy_tokens_and_logprobs_match_transformers(
    tmp_path_factory, gguf_path, hf_ref, model_type
) -> None:
    folder = _save(tmp_path_factory, model_type)
    impl = "transformers" if model_type == "llama" else "auto"
    check_against_transformers(folder, _hf(folder), gguf_path, hf_ref, model_impl=impl)


@pytest.mark.parametrize("model_type", [m for m in ARCHITECTURES if m != "llama"])
def test_bfloat16_agrees_with_float32(tmp_path_factory, gguf_path, model_type) -> None:
    check_bf16_agrees_with_float32(_save(tmp_path_factory, model_type), gguf_path, model_type)


def test_model_impl_chooses_the_implementation() -> None:
    assert model_impl_of(["LlamaForCausalLM"], "auto") == ("kiln", "LlamaForCausalLM")
    assert model_impl_of(["LlamaForCausalLM"], "transformers")[0] == "transformers"
    assert model_impl_of(["GPTNeoXForCausalLM"], "auto") == ("transformers", "GPTNeoXForCausalLM")
    assert "transformers' modeling code" in describe_model_impl(["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="--model-impl auto"):
        model_impl_of(["GPTNeoXForCausalLM"], "kiln")
    with pytest.raises(ValueError, match="not supported with model_impl='auto'"):
        model_impl_of(["NoSuchModelForCausalLM"], "auto")
    with pytest.raises(ValueError, match="model.model_impl"):
        ModelConfig(model_impl="vllm")


def test_lora_is_refused_with_the_transformers_backend(tmp_path_factory, gguf_path) -> None:
    folder = _save(tmp_path_factory, "gpt_neox")
    with pytest.raises(ValueError, match="lora.enable_lora=True is not supported"):
        LLM(folder, tokenizer=gguf_path, kv_cache_memory=0.02, enable_lora=True)


def test_kiln_serve_runs_a_transformers_architecture(tmp_path_factory, gguf_path, hf_ref) -> None:
    folder = _save(tmp_path_factory, "gpt_neox")
    hf_model = _hf(folder)
    log = check_served_against_transformers(folder, hf_model, gguf_path, hf_ref, PROMPTS[1:2])
    assert "runs as    GPTNeoXForCausalLM: transformers' modeling code" in log
