"""Kiln's Granite, OLMo 2, Phi-3, Gemma 2 and Gemma 3 against ``transformers``, through the
offline ``LLM``.

Each family is a small random model made by ``transformers`` from a seeded config
(``save_tiny_model``: two layers, four query heads over two KV heads, here a vocabulary of 251, no
multiple of 8), with random norm weights and biases (``random_norms``), saved as a Hugging Face
folder. Kiln serves the folder in float32 on the process's platform (kiln-x86 where it is
installed: a pytest process selects one platform) and must give transformers' greedy tokens for
32 steps, and logprobs (the chosen token and the top 5) within 1e-4 of transformers' float32
``log_softmax`` at every position. The configs switch on what is particular to each family:
Granite's four multipliers, OLMo 2's post-norm blocks and whole-projection q/k norms, Phi-3's
fused checkpoint projections and a sliding window shorter than the sequences; Gemma's sliding and
global layers (window 8, shorter than every sequence), soft caps small enough to change the
attention scores and the logits (Gemma 2), a ``head_dim`` and a ``query_pre_attn_scalar`` of
their own, tied embeddings, and Gemma 3's two rotary bases with linear scaling on the global one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from kiln import LLM, SamplingParams
from kiln.model_executor.models.phi3 import Phi3ForCausalLM
from kiln.testing.checks import _teacher_forced
from kiln.testing.models import TINY_GEMMA, save_tiny_model
from kiln.testing.server import KilnServer

# On save_tiny_model's defaults: two layers, four query heads over two KV heads (GQA).
COMMON = dict(
    vocab_size=251,  # no multiple of 8
    initializer_range=0.2,  # peaked logits: no greedy near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
GEMMA = TINY_GEMMA  # COMMON's fields, with a smaller initializer_range
FAMILIES = {
    "granite": dict(
        model_type="granite",
        embedding_multiplier=6.0,
        residual_multiplier=0.3,
        attention_multiplier=0.05,
        logits_scaling=2.5,
        attention_bias=True,
    ),
    "olmo2": dict(model_type="olmo2"),
    "phi3": dict(model_type="phi3", sliding_window=20),
    "gemma2": dict(
        model_type="gemma2", **GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=10.0
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        **GEMMA,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
}
NUM_TOKENS = 32
NUM_TOP = 5
LOGPROB_ATOL = 1e-4
MIN_TOP1_AGREEMENT = 0.99
TIE_MARGIN = 0.25
"""Nats between float32's top two logprobs under which bfloat16 may pick either: transformers'
own bfloat16 flips a position of Gemma 3's model below whose top two are 0.19 apart."""
PROMPTS = [
    [1, 5, 9, 200, 17],
    [3, 250, 7, 44, 12, 99, 8, 140, 61],
    [(11 * i) % 251 for i in range(1, 41)],
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, transformers model) of one family."""
    config = dict(FAMILIES[request.param])
    model_type = config.pop("model_type")
    folder = save_tiny_model(
        tmp_path_factory.mktemp(request.param),
        model_type,
        random_norms=True,
        **{**COMMON, **config},
    )
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return folder, hf_model


def test_greedy_tokens_and_logprobs_match_transformers(family, gguf_path, hf_ref) -> None:
    folder, hf_model = family
    check_against_transformers(folder, hf_model, gguf_path, hf_ref)


def check_against_transformers(
    folder: str, hf_model, tokenizer: str, hf_ref, model_impl: str = "auto"
) -> None:
    """Kiln's float32 greedy tokens and logprobs on ``PROMPTS`` against ``hf_model``'s (the MoE
    families' and the transformers backend's tests call it too)."""
    llm = LLM(
        folder,
        tokenizer=tokenizer,
        dtype="float32",
        kv_cache_memory=0.02,
        max_model_len=256,
        model_impl=model_impl,
    )
    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, logprobs=NUM_TOP, ignore_eos=True, detokenize=False
    )
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == hf_ref.greedy(hf_model, prompt, NUM_TOKENS)
        reference = hf_ref.logprobs(hf_model, prompt + completion.token_ids)
        assert completion.logprobs is not None and len(completion.logprobs) == NUM_TOKENS
        for i, (token, position) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = reference[len(prompt) - 1 + i]
            where = f"prompt of {len(prompt)} tokens, token {i}"
            hf_ref.check_position(position, row, token, NUM_TOP, where, atol=LOGPROB_ATOL)
    # Not a degenerate output: the prompts get different continuations.
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(PROMPTS)


def check_bf16_agrees_with_float32(
    folder: str,
    tokenizer: str,
    label: str,
    model_impl: str = "auto",
    options: dict | None = None,
    min_agreement: float = MIN_TOP1_AGREEMENT,
) -> None:
    """Teacher-forced on float32's greedy completions of ``PROMPTS``: bfloat16's (with
    ``options``, another run's: ``{"quantization": "int8"}``) most likely token is float32's at
    >= ``min_agreement`` of the positions where float32's top two differ by more than
    ``TIE_MARGIN``.

    NOTE: these tiny random models have near-ties that bfloat16's rounding flips whoever computes
    it: transformers' own bfloat16 agrees with its float32 at 0.95-0.98 of all positions here, so
    positions closer than ``TIE_MARGIN`` are left out (at most 40%, checked below)."""

    def llm(**extra) -> LLM:
        return LLM(
            folder,
            tokenizer=tokenizer,
            kv_cache_memory=0.02,
            max_model_len=256,
            model_impl=model_impl,
            **extra,
        )

    params = SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, logprobs=2, ignore_eos=True, detokenize=False
    )
    f32 = llm(dtype="float32")
    try:
        outputs = f32.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        f32.llm_engine.shutdown()
    completions = [o.outputs[0].token_ids for o in outputs]
    margins = []
    for output in outputs:
        for position in output.outputs[0].logprobs or []:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            margins.append(top[0] - top[1])
    bf16 = llm(**{"dtype": "bfloat16", **(options or {})})
    try:
        model = bf16.llm_engine.engine_core.executor.worker.model_runner.model
        assert options or next(model.parameters()).dtype == torch.bfloat16
        forced = _teacher_forced(bf16, PROMPTS, completions)
    finally:
        bf16.llm_engine.shutdown()
    tops = [row[0] for rows in forced for row in rows]
    tokens = [token for completion in completions for token in completion]
    assert len(tops) == len(tokens) == len(margins) == len(PROMPTS) * NUM_TOKENS
    clear = [(t, g) for t, g, m in zip(tops, tokens, margins, strict=True) if m > TIE_MARGIN]
    assert len(clear) >= 0.6 * len(tokens), f"{len(clear)} of {len(tokens)} positions clear"
    agreement = sum(t == g for t, g in clear) / len(clear)
    assert agreement >= min_agreement, f"top-1 agreement {agreement:.4f} of {len(clear)}"
    print(f"{label}: top-1 agreement {agreement:.4f} on {len(clear)} of {len(tokens)}")


def check_served_against_transformers(
    folder: str, hf_model, tokenizer: str, hf_ref, prompts: list[list[int]], *extra_args: str
) -> str:
    """``kiln serve`` of ``folder`` (float32) to the official client: each prompt's greedy tokens
    are ``hf_model``'s and their logprobs within ``LOGPROB_ATOL``. Returns the server's log."""
    from openai import OpenAI

    args = [folder, "--tokenizer", tokenizer, "--dtype", "float32", "--kv-cache-memory", "0.02"]
    args += ["--max-model-len", "256", "--served-model-name", "tiny", "--disable-log-stats"]
    server = KilnServer([*args, *extra_args])
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in prompts:
            choice = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=NUM_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            ).choices[0]
            tokens = choice.model_extra["token_ids"]
            assert tokens == hf_ref.greedy(hf_model, prompt, NUM_TOKENS)
            reference = hf_ref.logprobs(hf_model, prompt + tokens)
            assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
            for i, (token, logprob) in enumerate(
                zip(tokens, choice.logprobs.token_logprobs, strict=True)
            ):
                expected = float(reference[len(prompt) - 1 + i, token])
                assert abs(logprob - expected) <= LOGPROB_ATOL, (i, logprob, expected)
        return server.output()
    finally:
        server.stop()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 32.0}},
    ],
    ids=["su", "longrope"],
)
def test_phi3_refuses_long_context_rope(rope) -> None:
    config = {**Phi3Config(**COMMON).to_dict(), **rope}
    with pytest.raises(ValueError, match="rope_scaling"):
        Phi3ForCausalLM.parse_config(config)


def test_phi3_refuses_partial_rotary() -> None:
    config = {**Phi3Config(**COMMON).to_dict(), "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Phi3ForCausalLM.parse_config(config)
