"""Helpers of the parallel tests: the prompts and the greedy float32 generation they compare."""

from __future__ import annotations

from kiln import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
TOKEN_PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 200, 17, 3]},
    {"prompt_token_ids": [3, 256, 7]},  # 256: the last row of the odd vocabulary
    {"prompt_token_ids": [(11 * i) % 257 for i in range(1, 40)]},
]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]

SHARDED_SHAPES = dict(
    num_attention_heads=4,
    head_dim=32,
    vocab_size=257,  # odd: the last rank's shard has a padding row
    initializer_range=0.2,  # peaked logits: no greedy ties
)
"""The small random models' shapes (``save_tiny_model`` fields) that exercise the sharding."""
MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, mlp_only_layers=[0]
    ),
}
"""Per MoE model type, its routing fields (4 experts, top-2; Qwen3-MoE's first layer dense)."""


def small_llm(model: str, **kwargs) -> LLM:
    """An ``LLM`` of ``model`` in float32 with a small KV cache and context, and ``kwargs``."""
    return LLM(model, dtype="float32", kv_cache_memory=0.02, max_model_len=256, **kwargs)


def greedy_tokens(model: str, prompts: list, **kwargs) -> list[list[int]]:
    """Greedy float32 token ids of ``prompts`` from a ``small_llm`` built with ``kwargs``."""
    llm = small_llm(model, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
