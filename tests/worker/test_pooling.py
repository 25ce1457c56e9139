"""The pooling runner (``--runner pooling``) offline: ``LLM.embed`` / ``LLM.encode`` against
transformers' hidden-state pooling (``last_hidden_state``, after the final norm), on the default
model (its GGUF dequantized by transformers) and on a small random Llama, float32.

Also: batched inputs equal each input alone, chunked prefill equals a whole prefill, MEAN and
CLS never take prefix-cache hits (and equal a run without prefix caching) while LAST does, and
``dimensions`` / ``normalize`` cut and normalise as documented.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.entrypoints.llm import LLM
from kiln.pooling_params import PoolingParams
from kiln.sampling_params import SamplingParams
from kiln.testing.models import save_tiny_model

ATOL = 1e-4
BUDGET = 32
"""max_num_batched_tokens of the chunked engines: the long prompts take several steps."""
ENGINE = dict(dtype="float32", kv_cache_memory=0.1, max_model_len=256, runner="pooling")


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _reference(hf_model: torch.nn.Module, ids: list[int], pooling_type: str) -> torch.Tensor:
    """transformers' pooled final hidden state of ``ids`` (not normalised), float32."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()  # [n, H]
    return {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]


def _vectors(llm: LLM, prompts: list[list[int]], **params) -> list[torch.Tensor]:
    outputs = llm.encode(prompts, PoolingParams(**params), use_tqdm=False)
    return [output.outputs.data for output in outputs]


# -- the default model -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["LAST", "MEAN", "CLS"])
def default_llm(request, gguf_path: str) -> tuple[str, LLM]:
    """(pooling type, a chunked pooling engine of the default model with prefix caching on)."""
    config = {"pooling_type": request.param, "normalize": False}
    llm = LLM(gguf_path, pooler_config=config, max_num_batched_tokens=BUDGET, **ENGINE)
    return request.param, llm


def test_default_model_matches_transformers(default_llm, hf_model) -> None:
    pooling_type, llm = default_llm
    # 5 tokens, 20, and 70 (three chunks of the budget).
    prompts = _prompts(hf_model.config.vocab_size, (5, 20, 70), seed=0)
    for ids, got in zip(prompts, _vectors(llm, prompts), strict=True):
        want = _reference(hf_model, ids, pooling_type)
        assert got.shape == want.shape == (576,)
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
        normalized = _vectors(llm, [ids], normalize=True)[0]
        want_unit = torch.nn.functional.normalize(want, dim=0)
        assert torch.allclose(normalized, want_unit, atol=ATOL, rtol=0)


def test_batch_equals_alone(default_llm) -> None:
    _, llm = default_llm
    prompts = _prompts(1000, (9, 33, 50, 3), seed=1)
    batched = _vectors(llm, prompts, normalize=True)
    for ids, together in zip(prompts, batched, strict=True):
        alone = _vectors(llm, [ids], normalize=True)[0]
        assert torch.allclose(together, alone, atol=1e-5, rtol=0), (together - alone).abs().max()


def test_embed_output_shape(default_llm) -> None:
    """``embed``: vLLM's ``EmbeddingRequestOutput`` (``outputs.embedding`` a list of floats),
    unit length by default; ``dimensions`` keeps the first values, then normalises."""
    _, llm = default_llm
    text = "Kiln pools hidden states."
    (output,) = llm.embed(text, PoolingParams(normalize=True), use_tqdm=False)
    embedding = torch.tensor(output.outputs.embedding)
    assert output.outputs.hidden_size == 576 and output.finished
    assert output.prompt_token_ids == llm.get_tokenizer().encode(text)
    assert abs(float(embedding.norm()) - 1.0) < 1e-5
    (cut,) = llm.embed(text, PoolingParams(dimensions=64, normalize=True), use_tqdm=False)
    raw = _vectors(llm, [output.prompt_token_ids])[0]
    want = torch.nn.functional.normalize(raw[:64], dim=0)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), want, atol=1e-6)


def test_prefix_cache_use_by_pooling_type(default_llm, gguf_path: str) -> None:
    """Prompts sharing a 48-token prefix (3 blocks): LAST reuses the cached blocks; MEAN and CLS
    recompute them, and equal an engine without prefix caching."""
    pooling_type, llm = default_llm
    shared = _prompts(1000, (48,), seed=2)[0]
    first, second = shared + [5, 6, 7], shared + [8, 9, 10, 11]
    llm.encode([first], use_tqdm=False)
    (output,) = llm.encode([second], use_tqdm=False)
    if pooling_type == "LAST":
        assert output.num_cached_tokens == 48
        return
    assert output.num_cached_tokens == 0
    config = {"pooling_type": pooling_type, "normalize": False}
    plain = LLM(gguf_path, pooler_config=config, enable_prefix_caching=False, **ENGINE)
    want = _vectors(plain, [second])[0]
    assert torch.allclose(output.outputs.data, want, atol=1e-5, rtol=0)


def test_pooling_engine_refuses_generation(default_llm) -> None:
    _, llm = default_llm
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=577 is invalid"):
        llm.embed("Hello", PoolingParams(dimensions=577), use_tqdm=False)


def test_generate_engine_refuses_embeddings(llm_f32: LLM) -> None:
    with pytest.raises(ValueError, match="--runner pooling"):
        llm_f32.embed("Hello", use_tqdm=False)


# -- a small random model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(folder, transformers model) of a seeded 2-layer random Llama with random norms (vocab
    256, hidden 128)."""
    folder = save_tiny_model(tmp_path_factory.mktemp("pooling"), seed=3, random_norms=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_tiny_model_matches_transformers_chunked_and_whole(tiny, gguf_path, pooling_type) -> None:
    folder, hf = tiny
    config = {"pooling_type": pooling_type, "normalize": False}
    prompts = _prompts(256, (4, 31, 100), seed=4)
    chunked = LLM(
        folder, tokenizer=gguf_path, pooler_config=config, max_num_batched_tokens=BUDGET, **ENGINE
    )
    whole = LLM(folder, tokenizer=gguf_path, pooler_config=config, **ENGINE)
    for ids, got, unchunked in zip(
        prompts, _vectors(chunked, prompts), _vectors(whole, prompts), strict=True
    ):
        want = _reference(hf, ids, pooling_type)
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
        assert torch.allclose(got, unchunked, atol=1e-5, rtol=0)
