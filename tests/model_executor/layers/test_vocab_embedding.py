"""Embedding, LM head tying, and the logits processor."""

from __future__ import annotations

import pytest
import torch

from kiln.model_executor.layers.vocab_embedding import (
    LogitsProcessor,
    ParallelLMHead,
    VocabParallelEmbedding,
)


def test_embedding_looks_rows_up() -> None:
    embed = VocabParallelEmbedding(10, 4)
    weight = torch.randn(10, 4)
    embed.weight.weight_loader(embed.weight, weight)
    ids = torch.tensor([3, 0, 9, 3])
    torch.testing.assert_close(embed(ids), weight[ids], rtol=0, atol=0)


def test_tied_head_shares_the_embedding_parameter() -> None:
    module = torch.nn.Module()
    module.embed = VocabParallelEmbedding(10, 4)
    module.head = ParallelLMHead(10, 4).tie_weights(module.embed)
    assert module.head.weight is module.embed.weight
    # One parameter, so a loader fills both and "every parameter loaded" counts it once.
    assert [name for name, _ in module.named_parameters()] == ["embed.weight"]
    with pytest.raises(RuntimeError, match="LogitsProcessor"):
        module.head(torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_float32_for_the_given_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    head = ParallelLMHead(12, 8, bias=True, params_dtype=dtype)
    weight, bias = torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    head.weight.data.copy_(weight)
    head.bias.data.copy_(bias)
    hidden = torch.randn(3, 8, generator=gen).to(dtype)
    logits = LogitsProcessor(12)(head, hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 12)
    expected = hidden.float() @ weight.to(dtype).float().T + bias.to(dtype).float()
    tol = 0 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(logits, expected, rtol=tol, atol=tol or 1e-5)


def test_logits_processor_cuts_padded_vocab_and_scales() -> None:
    head = ParallelLMHead(16, 4)
    head.weight.data.copy_(torch.randn(16, 4))
    hidden = torch.randn(2, 4)
    logits = LogitsProcessor(10, scale=0.5)(head, hidden)
    torch.testing.assert_close(logits, 0.5 * (hidden @ head.weight.T)[:, :10])
