"""kiln-x86's compiled graph wrapper against the eager model, on a tiny random Llama (float32).

The model is two layers with grouped-query attention; its KV cache holds earlier tokens, so
attention really reads context. Buckets are (1, 2, 4): batch sizes 1..5 cover b - 1, b and b + 1
around every bucket, the last above the largest. A step is run as the model runner does: decode
rows padded to the bucket, the metadata covering the real rows only. Whether a call ran a compiled
graph is read from the profiler ("Torch-Compiled Region" events), and compiles are counted by
dynamo's graph counter.
"""

from __future__ import annotations

import pytest
import torch
from kiln_x86.graph import CompiledGraphWrapper

from kiln.config import KilnConfig
from kiln.forward_context import ForwardContext, set_forward_context
from kiln.model_executor.layers.attention import CommonAttentionMetadata, bind_kv_cache
from kiln.model_executor.model_loader import load_model
from kiln.testing.models import save_tiny_model
from kiln.worker.graph import padded_size

BUCKETS = (1, 2, 4)
BLOCK_SIZE = 4
NUM_BLOCKS = 64
CONTEXT = 9  # tokens cached per request before the decode step: three blocks, the last partial


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def make_tiny_model(folder):
    """The tiny Llama and its random KV caches, bound: ``(model, caches by layer name)``."""
    folder = save_tiny_model(
        folder,
        hidden_size=64,
        intermediate_size=96,
        initializer_range=0.1,
    )
    model, _ = load_model(str(folder), torch.float32, "cpu", load_format="safetensors")
    layers = model.attention_layers()
    first = next(iter(layers.values()))
    # The layers' backend is the platform's (x86's paged attention where kiln-x86 is selected).
    shape = first.backend.get_kv_cache_shape(
        NUM_BLOCKS, BLOCK_SIZE, first.num_kv_heads, first.head_size
    )
    gen = torch.Generator().manual_seed(1)
    caches = {name: torch.randn(shape, generator=gen) for name in layers}
    bind_kv_cache(model, caches)
    return model, caches


@pytest.fixture(scope="module")
def wrapper(tiny_model):
    model, _ = tiny_model
    wrapper = CompiledGraphWrapper(model, KilnConfig())
    # As the worker does: an eager warm-up first (ops resolve their implementations), then capture.
    _step(model, tiny_model, 1, 1)
    before = _num_graphs()
    with torch.inference_mode():
        wrapper.capture(list(BUCKETS))
        for size in reversed(BUCKETS):  # as the runner does: one dummy decode per bucket
            _step(wrapper, tiny_model, size, size)
    assert _num_graphs() - before == len(BUCKETS)
    return wrapper


def _num_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _step(fn, tiny_model, num_reqs: int, num_tokens: int, prefill: bool = False):
    """Run ``fn`` on a decode step of ``num_reqs`` requests (or one prefill of ``num_reqs``
    tokens) padded to ``num_tokens`` rows. Returns (hidden states, ran a compiled graph)."""
    model, _ = tiny_model
    gen = torch.Generator().manual_seed(num_reqs)
    if prefill:
        common = CommonAttentionMetadata.from_block_tables(
            [num_reqs], [0], [[1, 2, 3, 4]], BLOCK_SIZE
        )
        first_position = 0
    else:
        # Request i owns blocks 3i+1..3i+3 (never the null block 0) and decodes position CONTEXT.
        tables = [[3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(num_reqs)]
        common = CommonAttentionMetadata.from_block_tables(
            [1] * num_reqs, [CONTEXT] * num_reqs, tables, BLOCK_SIZE
        )
        first_position = CONTEXT
    backend = next(iter(model.attention_layers().values())).backend
    metadata = backend.get_metadata_builder_cls()(BLOCK_SIZE, "cpu").build(common)
    context = ForwardContext(metadata, num_tokens, attention_layers=model.attention_layers())
    # Inputs made under inference_mode, as the runner's are (a graph guards on it).
    with torch.inference_mode():
        input_ids = torch.zeros(num_tokens, dtype=torch.int64)  # padding: token 0, position 0
        input_ids[:num_reqs] = torch.randint(0, 256, (num_reqs,), generator=gen)
        positions = torch.zeros(num_tokens, dtype=torch.int64)
        positions[:num_reqs] = first_position + (torch.arange(num_reqs) if prefill else 0)
        with (
            set_forward_context(context),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        ):
            hidden = fn(input_ids, positions)
    compiled = any("Torch-Compiled Region" in event.name for event in prof.events())
    return hidden, compiled


@pytest.mark.parametrize("num_reqs", range(1, max(BUCKETS) + 2))
def test_padded_decode_matches_eager_at_bucket_edges(tiny_model, wrapper, num_reqs) -> None:
    model, caches = tiny_model
    saved = {name: cache.clone() for name, cache in caches.items()}
    size = padded_size(BUCKETS, num_reqs)
    before = _num_graphs()
    hidden, compiled = _step(wrapper, tiny_model, num_reqs, size or num_reqs)
    written = {name: cache.clone() for name, cache in caches.items()}
    for name, cache in caches.items():
        cache.copy_(saved[name])
    expected, _ = _step(model, tiny_model, num_reqs, num_reqs)  # eager, unpadded
    assert compiled == (size is not None)  # above the largest bucket: eager
    assert _num_graphs() == before  # never a compile while serving
    torch.testing.assert_close(hidden[:num_reqs], expected, rtol=0, atol=1e-5)
    # The compiled step wrote the same keys and values, and padding rows wrote nothing.
    for name, cache in caches.items():
        torch.testing.assert_close(written[name], cache, rtol=0, atol=1e-5)
        cache.copy_(saved[name])


def test_shape_outside_the_buckets_runs_eagerly(tiny_model, wrapper) -> None:
    """A 3-token prefill sent through the wrapper anyway (the runner runs prefills eagerly itself,
    tests/worker/test_graph_buckets.py): no graph, no compile, the eager model's result."""
    model, caches = tiny_model
    saved = {name: cache.clone() for name, cache in caches.items()}
    before = _num_graphs()
    hidden, compiled = _step(wrapper, tiny_model, 3, 3, prefill=True)
    for name, cache in caches.items():
        cache.copy_(saved[name])
    expected, _ = _step(model, tiny_model, 3, 3, prefill=True)
    assert not compiled and _num_graphs() == before
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
