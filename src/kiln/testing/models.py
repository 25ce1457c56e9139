"""Small random models on disk, for tests that need an architecture or a size the default model
does not have (plugin test suites use them too)."""

from __future__ import annotations

import pathlib
from typing import Any

TINY_GEMMA: dict[str, Any] = dict(
    vocab_size=251,  # no multiple of 8
    # Smaller than the usual 0.2: sqrt(hidden) times a tied embedding otherwise repeats the prompt.
    initializer_range=0.05,
    tie_word_embeddings=True,
    head_dim=48,  # not hidden_size / num_attention_heads (32)
    query_pre_attn_scalar=40,  # not head_dim
    sliding_window=8,  # shorter than most prompts plus their completions
    layer_types=["sliding_attention", "full_attention"],
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
"""``save_tiny_model`` fields of a small Gemma 2 / Gemma 3 (``gemma2`` / ``gemma3_text``) in
which each Gemma-specific piece changes the output; add the soft caps (Gemma 2) or the rotary
bases (Gemma 3) a test needs."""


def save_tiny_model(
    folder: str | pathlib.Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    tokenizer: Any = None,
    random_norms: bool = False,
    **config: Any,
) -> str:
    """Write a random float32 model (safetensors and ``config.json``) to ``folder``; return it.

    ``model_type`` is a Hugging Face model type Kiln serves (``llama``, ``qwen2``, ``qwen3``, ...).
    The defaults are a 2-layer model with 4 query heads over 2 KV heads, hidden size 128 and a
    256-token vocabulary. ``config`` overrides any field of the model type's ``transformers``
    config (``initializer_range=0.2`` gives peaked logits, so greedy ties are unlikely). With a
    ``tokenizer`` (a Hugging Face tokenizer), the vocabulary is the tokenizer's and the tokenizer is
    saved next to the weights, so the folder serves text. ``random_norms`` randomizes the norm
    weights and biases (``randomize_norms_and_biases``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer) if tokenizer is not None else 256,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    fields.update(config)
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if random_norms:
        randomize_norms_and_biases(model, seed + 1)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


def randomize_norms_and_biases(model: Any, seed: int = 1) -> None:
    """Set every norm weight of a ``transformers`` model to ``1 + 0.3 N(0, 1)`` and every bias to
    ``0.1 N(0, 1)``, so that a mis-mapped norm or bias cannot hide behind the all-ones / zeros
    init. Seeded: the same model gets the same values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
