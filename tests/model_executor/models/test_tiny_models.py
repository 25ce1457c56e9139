"""Kiln's Llama, Mistral, Qwen2 and Qwen3 against ``transformers`` on tiny random checkpoints.

Each variant is a small random model made by ``transformers`` (GQA, two layers), with random norm
weights and biases so a mis-mapped tensor cannot hide behind an all-ones init, saved as safetensors
and loaded by Kiln through the safetensors loader. Variants cover the config switches: Llama with
llama3 rope scaling, attention and MLP biases, untied head; Mistral with a sliding window on every
layer; Qwen2 with tied embeddings, and with a sliding window on its second layer; Qwen3 with q/k
norms and a head_dim that is not hidden / heads.

float32 throughout; the only differences are summation order, so logits agree to ~1e-6 and we
allow 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from kiln.model_executor.model_loader import load_model
from kiln.testing.models import randomize_norms_and_biases

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)
VARIANTS = {
    "llama3_rope_biases": lambda: LlamaConfig(
        **COMMON,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral_sliding": lambda: MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
    "qwen2_tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen2_sliding": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}
LOGIT_ATOL = 1e-4


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 13, 30)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(kiln model, transformers model, config dict) of one variant."""
    torch.manual_seed(0)
    config = VARIANTS[request.param]()
    config._attn_implementation = "eager"
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_norms_and_biases(hf_model, seed=1)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    model, hf_config = load_model(str(folder), torch.float32, "cpu", load_format="safetensors")
    return model, hf_model, hf_config


def test_config_reaches_the_model(models) -> None:
    model, _, hf_config = models
    args = model.args
    name = hf_config["architectures"][0]
    assert type(model).__name__ == name.replace("Mistral", "Llama")
    if name == "Qwen3ForCausalLM":
        assert args.head_dim == 32 and hasattr(model.model.layers[0].self_attn, "q_norm")
    if name == "Qwen2ForCausalLM":
        assert args.qkv_bias and not args.o_proj_bias
    windows = [layer.sliding_window for layer in model.attention_layers().values()]
    expected = {
        "LlamaForCausalLM": [None, None],
        "MistralForCausalLM": [8, 8],
        "Qwen2ForCausalLM": [None, 8] if hf_config.get("use_sliding_window") else [None, None],
        "Qwen3ForCausalLM": [None, None],
    }[name]
    assert windows == expected


def test_logits_match_transformers(models, paged_runner, hf_ref) -> None:
    model, hf_model, _ = models
    prompts = _prompts(0)
    runner = paged_runner(model, block_size=4)
    logits = runner.step([(str(i), p) for i, p in enumerate(prompts)])  # one batched prefill
    for row, prompt in zip(logits, prompts, strict=True):
        torch.testing.assert_close(row, hf_ref.logits(hf_model, prompt), rtol=0, atol=LOGIT_ATOL)


def test_greedy_tokens_match_transformers(models, paged_runner, hf_ref) -> None:
    model, hf_model, _ = models
    prompts = _prompts(1)
    ours = paged_runner(model, block_size=4, seed=3).greedy(prompts, 12)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_ref.greedy(hf_model, prompt, 12)


def test_chunked_prefill_and_decodes_match_full_prefill(models, paged_runner) -> None:
    model, _, _ = models
    prompt = _prompts(2)[2] + _prompts(3)[1]  # 43 tokens: spans the sliding windows
    full_logits, full_hidden = paged_runner(model, block_size=4).step(
        [("full", prompt)], return_hidden=True
    )
    # Another request decoding in the same steps, and a shuffled block table.
    runner = paged_runner(model, block_size=4, seed=7)
    runner.step([("other", _prompts(4)[0])])
    hidden = []
    for start, end in ((0, 1), (1, 10), (10, 11), (11, 32), (32, len(prompt))):
        logits, h = runner.step([("other", [5]), ("chunked", prompt[start:end])], True)
        hidden.append(h[1:])
    torch.testing.assert_close(torch.cat(hidden), full_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1:], full_logits, rtol=0, atol=1e-5)

    # Decoding after the chunks equals decoding after the full prefill.
    full_runner = paged_runner(model, block_size=4, seed=8)
    full_runner.step([("full", prompt)])
    torch.testing.assert_close(
        runner.step([("chunked", [9])]), full_runner.step([("full", [9])]), rtol=0, atol=1e-5
    )
