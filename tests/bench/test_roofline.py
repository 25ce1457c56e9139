"""The roofline's model arithmetic and bounds (``kiln.bench.roofline``), against figures worked out
by hand from the default model's architecture and GGUF's block formats."""

from __future__ import annotations

import pytest

from kiln.bench.roofline import Machine, ModelShape, measure_machine, workload_bound
from kiln.model_executor.loader.default_model import default_model_path


def test_the_default_models_shape_and_bytes_per_step():
    """SmolLM2-135M: 30 layers of q, o (576 x 576), k, v (576 x 192), gate, up, down (576 x
    1536), and the LM head tied to the 49152 x 576 embedding. Q4_1 stores 32 weights in 20 bytes,
    Q8_0 in 34, the 61 norms are float32."""
    shape = ModelShape.from_gguf(default_model_path())
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    lm_head = 49152 * 576
    assert (shape.num_layers, shape.num_heads, shape.head_dim) == (30, 9, 64)
    assert shape.linear_params == 30 * per_layer + lm_head
    norms = (2 * 30 + 1) * 576 * 4
    assert shape.weight_bytes == 30 * per_layer * 20 // 32 + lm_head * 34 // 32 + norms
    assert shape.lm_head_params == lm_head
    assert shape.flops_per_token(100) == 2 * shape.linear_params + 4 * 30 * 9 * 64 * 100
    assert shape.flops_per_token(100, logits=False) == shape.flops_per_token(100) - 2 * lm_head
    assert shape.with_weight_bytes(2).weight_bytes == 2 * shape.linear_params


MACHINE = Machine(bandwidth_gbs=10.0, peak_gflops={"float32": 100, "bfloat16": 400, "int8": 200})
TINY = ModelShape(
    num_layers=1, num_heads=1, head_dim=1, linear_params=10**6, lm_head_params=0, weight_bytes=10**8
)


def test_one_stream_is_bound_by_reading_the_weights():
    # 10 decode steps, each reading 1e8 bytes at 1e10 B/s: 0.1 s for 10 tokens; one prefill of
    # 10 tokens is 2e7 FLOPs (plus attention's 4 * 45) at 4e11/s, under one read of the weights.
    bound = workload_bound(MACHINE, TINY, concurrency=1, input_len=10, output_len=10, num_prompts=1)
    assert bound.limit == "memory"
    assert bound.output_tok_s == pytest.approx(100.0)
    assert bound.ttft_ms == pytest.approx(10.0)


def test_a_large_batch_is_bound_by_the_fastest_matrix_rate():
    # 1000 prompts of 1000 tokens, one output token each, all at once: one decode step (0.01 s
    # of weights), but 1000 * (1000 * 2e6 + 4 * 499500 + 2e6 + 4 * 1000) FLOPs at bf16's 4e11/s.
    bound = workload_bound(
        MACHINE, TINY, concurrency=1000, input_len=1000, output_len=1, num_prompts=1000
    )
    flops = 1000 * (1000 * 2e6 + 4 * 499500 + 2e6 + 4 * 1000)
    assert bound.limit == "bfloat16"
    assert bound.output_tok_s == pytest.approx(1000 / (flops / 4e11))
    # Its prompt's 5 ms of FLOPs take less than one read of the weights (10 ms); 4000 tokens more.
    assert bound.ttft_ms == pytest.approx(10.0)
    long = workload_bound(MACHINE, TINY, concurrency=1, input_len=4000, output_len=1, num_prompts=1)
    assert long.ttft_ms == pytest.approx((4000 * 2e6 + 4 * 3999 * 4000 / 2) / 4e11 * 1e3)


def test_the_machine_is_measured_here():
    machine = measure_machine(num_threads=1, array_mib=8, size=64, repeats=1)
    assert machine.bandwidth_gbs > 0
    assert set(machine.peak_gflops) == {"float32", "bfloat16", "int8"}
    assert all(rate > 0 for rate in machine.peak_gflops.values())
    assert "GB/s" in machine.describe()


def test_a_prompt_computes_logits_for_its_last_token_only():
    # Half of each token's 1e6 weights are the LM head: 10 prompt tokens at 5e5 multiply-adds
    # each, the last one's logits (5e5 more), attention's 4 * 45; at bf16's 4e11 FLOP/s.
    model = ModelShape(1, 1, 1, linear_params=10**6, lm_head_params=5 * 10**5, weight_bytes=1)
    bound = workload_bound(MACHINE, model, concurrency=1, input_len=10, output_len=1, num_prompts=1)
    assert bound.ttft_ms == pytest.approx((10 * 1e6 + 1e6 + 4 * 45) / 4e11 * 1e3)
