"""What the parallel tests compare against, computed once per session: greedy float32 tokens at
TP=1 (one process) of a small random Llama and of the default model."""

from __future__ import annotations

import pathlib
import sys

import pytest

from kiln.testing.models import save_tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from parallel_utils import TEXT_PROMPTS, TOKEN_PROMPTS, greedy_tokens  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, gguf_path) -> tuple[str, list[list[int]]]:
    """A random Llama (4 KV heads, vocabulary 257, 3 layers: an uneven split over two stages)
    and its TP=1 greedy tokens of ``TOKEN_PROMPTS``."""
    folder = save_tiny_model(
        tmp_path_factory.mktemp("parallel") / "llama",
        "llama",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=257,
        initializer_range=0.2,  # peaked logits: no greedy ties
    )
    tokens = greedy_tokens(folder, TOKEN_PROMPTS, tokenizer=gguf_path)
    assert len({tuple(t) for t in tokens}) == len(TOKEN_PROMPTS)  # not a degenerate output
    return folder, tokens


@pytest.fixture(scope="session")
def default_model_tokens(gguf_path) -> list[list[int]]:
    """TP=1 greedy tokens of ``TEXT_PROMPTS`` on the default model (dense, as ranks load it)."""
    return greedy_tokens(gguf_path, TEXT_PROMPTS, quantization="none")
