"""Tensor parallelism with the multiprocess executor: greedy tokens in float32 at TP=2 equal TP=1
on the default model and on small random models whose shapes exercise the sharding (4 KV heads
split over ranks, 1 KV head replicated, a vocabulary of 257 rows padded to 258); on a plugin's
platform, the model's collectives (TP=2) and stage transfers (PP=2) run through the communicator
the plugin names; quantized weights are refused with more than one rank, a draft model's too;
architectures served by transformers' code are sharded by their ``base_model_tp_plan``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from parallel_utils import MOE_CONFIGS, SHARDED_SHAPES

from kiln import LLM, SamplingParams
from kiln.config import KilnConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from kiln.distributed.parallel_state import prepare_tensor_parallel_config
from kiln.testing.models import TINY_GEMMA, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
TOKEN_PROMPTS = [
    {"prompt_token_ids": [1, 5, 9, 200, 17, 3]},
    {"prompt_token_ids": [3, 256, 7]},  # 256: a row of the last rank's vocabulary shard
    {"prompt_token_ids": [(11 * i) % 257 for i in range(1, 40)]},
]


def _greedy(model: str, tp: int, prompts: list, **kwargs) -> list[list[int]]:
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory=0.02,
        max_model_len=256,
        **kwargs,
    )
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()


# This test's vocabulary (257: a padding row) and head size; the rest of TINY_GEMMA's fields.
GEMMA = {**TINY_GEMMA, "vocab_size": 257, "head_dim": 32}
EXTRA = {
    # Phi-3's default special tokens (32000) lie outside the small vocabulary.
    "phi3": {"pad_token_id": None, "eos_token_id": 2},
    "gemma2": {**GEMMA, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 10.0},
    "gemma3_text": {
        **GEMMA,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    },
}
"""Per model type, config fields beside the shapes the test sets."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "num_kv_heads"),
    [
        ("llama", 4),
        ("qwen3", 4),
        ("llama", 1),
        ("granite", 4),
        ("olmo2", 4),
        ("olmo2", 1),
        ("phi3", 4),
        ("mixtral", 4),
        ("qwen3_moe", 4),
        ("gemma2", 4),
        ("gemma3_text", 1),
    ],
    ids=[
        "llama-4kv",
        "qwen3-4kv",
        "llama-1kv-replicated",
        "granite-4kv",
        "olmo2-4kv",  # q/k norms over the whole projections: statistics summed over ranks
        "olmo2-1kv-replicated",
        "phi3-4kv",  # fused checkpoint projections split per rank
        "mixtral-4kv",  # experts' intermediate dimension split per rank
        "qwen3_moe-4kv",  # and a dense layer beside the sparse one
        "gemma2-4kv",  # soft caps, sliding and global layers, tied embeddings
        "gemma3-1kv-replicated",  # q/k norms per head, two rotary bases
    ],
)
def test_tp2_greedy_tokens_equal_tp1_on_small_random_models(
    tmp_path, gguf_path, model_type, num_kv_heads
):
    config = dict(SHARDED_SHAPES, num_key_value_heads=num_kv_heads)
    folder = save_tiny_model(
        tmp_path / model_type,
        model_type,
        random_norms=True,  # a norm weight sharded wrongly cannot hide behind ones
        **{**config, **EXTRA.get(model_type, {}), **MOE_CONFIGS.get(model_type, {})},
    )
    tp1 = _greedy(folder, 1, TOKEN_PROMPTS, tokenizer=gguf_path)
    tp2 = _greedy(folder, 2, TOKEN_PROMPTS, tokenizer=gguf_path)
    assert tp2 == tp1
    assert len({tuple(t) for t in tp1}) == len(TOKEN_PROMPTS)  # not a degenerate output


TRANSFORMERS_ARCHITECTURES = {
    # fused query_key_value split by whole heads (colwise), an embedding the plan shards kept whole
    "gpt_neox": dict(num_key_value_heads=None, rotary_pct=0.5),
    "starcoder2": dict(num_key_value_heads=2, sliding_window=6),  # one KV head per rank
    "cohere": dict(num_key_value_heads=2, logit_scale=2.0),
}


@pytest.mark.parametrize("model_type", list(TRANSFORMERS_ARCHITECTURES))
def test_tp2_equals_tp1_through_the_transformers_backend(tmp_path, gguf_path, model_type):
    """Architectures Kiln has no class for (``model_impl`` auto: transformers' code), their linear
    layers sharded by transformers' ``base_model_tp_plan``."""
    folder = save_tiny_model(
        tmp_path / model_type,
        model_type,
        random_norms=True,
        vocab_size=257,
        initializer_range=0.2,
        **TRANSFORMERS_ARCHITECTURES[model_type],
    )
    tp1 = _greedy(folder, 1, TOKEN_PROMPTS, tokenizer=gguf_path)
    tp2 = _greedy(folder, 2, TOKEN_PROMPTS, tokenizer=gguf_path)
    assert tp2 == tp1
    assert len({tuple(t) for t in tp1}) == len(TOKEN_PROMPTS)


def test_tp_without_a_plan_is_refused_through_the_transformers_backend(tmp_path, gguf_path):
    """GPT-2 (``Conv1D`` layers) has no ``base_model_tp_plan`` to shard by."""
    folder = save_tiny_model(tmp_path / "gpt2", "gpt2", num_key_value_heads=None, vocab_size=257)
    with pytest.raises(Exception, match="has no base_model_tp_plan"):
        _greedy(folder, 2, TOKEN_PROMPTS, tokenizer=gguf_path)


@pytest.mark.slow
def test_tp2_greedy_tokens_equal_tp1_on_the_default_model(gguf_path):
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    tp1 = _greedy(gguf_path, 1, prompts, quantization="none")
    # quantization auto: dense weights with more than one rank.
    tp2 = _greedy(gguf_path, 2, prompts)
    assert tp2 == tp1
    # With the default model drafting for itself: the draft's GGUF weights go dense too, and it
    # is sharded as the target (before, the ranks refused its quantized embedding).
    draft = {"model": gguf_path, "num_speculative_tokens": 3}
    assert _greedy(gguf_path, 2, prompts[:2], speculative_config=draft) == tp1[:2]


PLUGIN_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from parallel_utils import TOKEN_PROMPTS, greedy_tokens
sizes = [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
# Buckets named as a user (or a platform) would: captured at TP=1 only.
buckets = {"graph_capture_sizes": [1, 2]}
tokens = [
    greedy_tokens(sys.argv[2], TOKEN_PROMPTS, tokenizer=sys.argv[3], **buckets, **s) for s in sizes
]
print(json.dumps(tokens))
"""


@pytest.mark.slow
def test_collectives_run_through_the_communicator_the_platform_names(
    tmp_path, tiny_llama, gguf_path
):
    folder, _ = tiny_llama  # its tokens are the x86 platform's: compared here on the plugin's
    log = tmp_path / "collectives.log"
    graph_log = tmp_path / "graphs.log"
    # The test plugin's platform (a process selects its platform once: a fresh interpreter).
    env = {
        **os.environ,
        "KILN_TEST_PLATFORM": "1",
        "KILN_PLATFORM": "kiln_test",
        "KILN_TEST_COMMUNICATOR_LOG": str(log),
        "KILN_TEST_GRAPH_LOG": str(graph_log),
    }
    here = str(pathlib.Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", PLUGIN_RUN, here, folder, gguf_path],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp1, tp2, pp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tp2 == tp1 and pp2 == tp1
    # Rank 0 of TP=2 and of PP=2 write "0 ...": the TP and PP runs each log their own methods.
    calls = set(log.read_text().splitlines())
    tp_calls = {f"{rank} {method}" for rank in (0, 1) for method in ("all_reduce", "all_gather")}
    assert tp_calls <= calls, calls
    assert {"0 send", "1 recv"} <= calls, calls
    # Graphs are off with more than one rank (a trace cannot record collectives); with one rank
    # the named buckets are captured.
    assert graph_log.read_text().splitlines() == ["tp=1 pp=1 rank=0 capture [1, 2]"]


@pytest.mark.parametrize("method", ["gguf", "int8", "int4"])
def test_quantized_weights_are_refused_with_more_than_one_rank(method):
    config = KilnConfig(
        model=ModelConfig(quantization=method), parallel=ParallelConfig(tensor_parallel_size=2)
    )
    with pytest.raises(ValueError, match=rf"model.quantization='{method}'.*allowed: 'auto' or"):
        prepare_tensor_parallel_config(config)


def test_auto_quantization_means_dense_weights_with_more_than_one_rank():
    config = KilnConfig(parallel=ParallelConfig(tensor_parallel_size=2))
    assert prepare_tensor_parallel_config(config).model.quantization == "none"
    single = KilnConfig(model=ModelConfig(quantization="gguf"))
    assert prepare_tensor_parallel_config(single) is single


def _with_draft(quantization: str | None) -> KilnConfig:
    draft = SpeculativeConfig(
        method="draft_model", model="d.gguf", num_speculative_tokens=2, quantization=quantization
    )
    return KilnConfig(parallel=ParallelConfig(tensor_parallel_size=2), speculative=draft)


@pytest.mark.parametrize("method", ["gguf", "int8", "int4"])
def test_a_quantized_draft_model_is_refused_with_more_than_one_rank(method):
    # Before: the ranks failed while building the draft, naming model.quantization.
    with pytest.raises(ValueError, match=rf"speculative.quantization='{method}'.*allowed: 'auto'"):
        prepare_tensor_parallel_config(_with_draft(method))


def test_a_draft_model_has_dense_weights_with_more_than_one_rank():
    for auto in (None, "auto"):
        assert prepare_tensor_parallel_config(_with_draft(auto)).speculative.quantization == "none"
