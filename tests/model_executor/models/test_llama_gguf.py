"""Kiln's Llama on the default model (SmolLM2-135M GGUF) against ``transformers`` on the same file.

The reference is built the way ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``
builds it (config and dequantized tensors from transformers' own GGUF reader), without that call's
``accelerate`` requirement. Both sides run in float32 on identical weights, so differences are only
accumulation order (fused qkv/gate_up matmuls, SDPA vs eager attention, a paged gather): over 30
layers that is ~1e-5 relative; logits of magnitude ~20 differ by well under 1e-3, our tolerance.
"""

from __future__ import annotations

import pytest
import torch

from kiln.model_executor.model_loader import load_model

pytestmark = pytest.mark.slow

# Token ids of the default model's tokenizer (no BOS, as its GGUF asks).
PROMPTS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "def fibonacci(n):": [1604, 3987, 46477, 24, 94, 727],
    # "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    "chat": [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],
}
LOGIT_ATOL = 1e-3
NUM_GREEDY = 32


@pytest.fixture(scope="module")
def kiln_model(gguf_path: str) -> torch.nn.Module:
    model, config = load_model(gguf_path, torch.float32, "cpu")
    assert config["architectures"] == ["LlamaForCausalLM"]
    return model


def test_prompt_logits_match_transformers(kiln_model, hf_model, paged_runner, hf_ref) -> None:
    runner = paged_runner(kiln_model, block_size=16)
    # All prompts in one prefill step: a batch of three requests.
    logits = runner.step([(text, ids) for text, ids in PROMPTS.items()])
    worst = 0.0
    for row, ids in zip(logits, PROMPTS.values(), strict=True):
        ref = hf_ref.logits(hf_model, ids)
        worst = max(worst, (row - ref).abs().max().item())
        torch.testing.assert_close(row, ref, rtol=0, atol=LOGIT_ATOL)
        assert row.argmax() == ref.argmax()
    print(f"max abs logit diff vs transformers: {worst:.2e}")


def test_greedy_tokens_match_transformers(kiln_model, hf_model, paged_runner, hf_ref) -> None:
    prompts = [PROMPTS["The capital of France is"], PROMPTS["chat"]]
    runner = paged_runner(kiln_model, block_size=4)
    ours = runner.greedy(prompts, NUM_GREEDY)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_ref.greedy(hf_model, prompt, NUM_GREEDY)


def test_decodes_and_chunked_prefill_in_one_batch(kiln_model, paged_runner) -> None:
    """One request decodes while another's prompt arrives in chunks, in the same steps."""
    prompt = PROMPTS["chat"] + PROMPTS["def fibonacci(n):"]
    full = paged_runner(kiln_model, block_size=4)
    full_logits, full_hidden = full.step([("a", prompt)], return_hidden=True)

    runner = paged_runner(kiln_model, block_size=4, seed=1)
    runner.step([("b", PROMPTS["The capital of France is"])])
    hidden, next_b = [], 504
    for start, end in ((0, 5), (5, 13), (13, len(prompt))):
        logits, h = runner.step([("b", [next_b]), ("a", prompt[start:end])], return_hidden=True)
        hidden.append(h[1:])
        next_b = int(logits[0].argmax())
    torch.testing.assert_close(torch.cat(hidden), full_hidden, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits[1:], full_logits, rtol=0, atol=1e-4)


def test_attention_layers_are_named_by_layer(kiln_model) -> None:
    layers = kiln_model.attention_layers()
    assert len(layers) == 30
    assert list(layers)[:2] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
