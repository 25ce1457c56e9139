"""kiln-x86's traced graph wrapper (``x86.graph = "trace"``) against the eager model.

The same tiny random Llama, KV cache and decode steps as ``test_graph.py`` (buckets 1, 2, 4;
batch sizes 1..5 around every bucket edge). A replayed graph runs no Python module: whether a call
replayed one is read from a forward pre-hook on the model's decoder layers, which only an eager
forward (or the trace itself) calls. The replay runs the kernels the eager model runs, so a padded
step equals the eager step of the same padded size bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from kiln_x86.graph import TracedGraphWrapper
from test_graph import BUCKETS, _step, make_tiny_model

from kiln.config import KilnConfig
from kiln.worker.graph import padded_size


class LayerCalls:
    """Counts forward calls of the model's decoder layers (Python forwards only)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        for layer in model.model.layers:
            layer.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def traced(tiny_model):
    model, _ = tiny_model
    calls = LayerCalls(model)
    wrapper = TracedGraphWrapper(model, KilnConfig())
    _step(model, tiny_model, 1, 1)  # an eager warm-up first, as the worker does
    wrapper.capture(list(BUCKETS))
    for size in reversed(BUCKETS):
        _step(wrapper, tiny_model, size, size)
    assert sorted(wrapper._graphs) == sorted(BUCKETS)
    return wrapper, calls


def _restore(caches, saved) -> dict[str, torch.Tensor]:
    written = {name: cache.clone() for name, cache in caches.items()}
    for name, cache in caches.items():
        cache.copy_(saved[name])
    return written


@pytest.mark.parametrize("num_reqs", range(1, max(BUCKETS) + 2))
def test_replay_matches_eager_at_bucket_edges(tiny_model, traced, num_reqs) -> None:
    model, caches = tiny_model
    wrapper, calls = traced
    saved = {name: cache.clone() for name, cache in caches.items()}
    size = padded_size(BUCKETS, num_reqs)
    rows = size or num_reqs
    before = calls.count
    hidden, _ = _step(wrapper, tiny_model, num_reqs, rows)
    replayed = calls.count == before
    written = _restore(caches, saved)
    expected, _ = _step(model, tiny_model, num_reqs, rows)  # eager, same padded rows
    assert replayed == (size is not None)  # above the largest bucket: eager
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    # The same keys and values written, and padding rows wrote nothing.
    for name, cache in caches.items():
        torch.testing.assert_close(written[name], cache, rtol=0, atol=0)
    _restore(caches, saved)
    unpadded, _ = _step(model, tiny_model, num_reqs, num_reqs)
    torch.testing.assert_close(hidden[:num_reqs], unpadded, rtol=0, atol=1e-5)
    _restore(caches, saved)


def test_shape_outside_the_buckets_runs_eagerly(tiny_model, traced) -> None:
    model, caches = tiny_model
    wrapper, calls = traced
    saved = {name: cache.clone() for name, cache in caches.items()}
    before = calls.count
    hidden, _ = _step(wrapper, tiny_model, 3, 3, prefill=True)
    assert calls.count > before  # eager: the layers' Python forwards ran
    _restore(caches, saved)
    expected, _ = _step(model, tiny_model, 3, 3, prefill=True)
    _restore(caches, saved)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_prefill_padded_to_a_bucket_replays_its_trace(tiny_model, traced) -> None:
    """A graph holds nothing of the decode step it was traced on: a 3-token prompt padded to the
    4-token bucket (as the runner pads any step that fits one) replays that trace and equals the
    eager step of the same padded rows bit for bit."""
    model, caches = tiny_model
    wrapper, calls = traced
    saved = {name: cache.clone() for name, cache in caches.items()}
    before = calls.count
    hidden, _ = _step(wrapper, tiny_model, 3, 4, prefill=True)
    assert calls.count == before  # replayed: no layer's Python forward ran
    written = _restore(caches, saved)
    expected, _ = _step(model, tiny_model, 3, 4, prefill=True)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    for name, cache in caches.items():
        torch.testing.assert_close(written[name], cache, rtol=0, atol=0)
    _restore(caches, saved)


def test_capture_leaves_each_graph_optimized(tiny_model) -> None:
    """TorchScript profiles a graph's first run and builds its optimized plan in the second
    (about 0.1 s for the default model): capture does both, so the bucket's first real step
    does not pay for them."""
    model, caches = tiny_model
    saved = {name: cache.clone() for name, cache in caches.items()}
    wrapper = TracedGraphWrapper(model, KilnConfig())
    wrapper.capture([2])
    _step(wrapper, tiny_model, 2, 2)  # the runner's capture call
    _restore(caches, saved)
    # Raises "optimized_plan_ INTERNAL ASSERT FAILED" while the graph has no optimized plan.
    assert len(wrapper._graphs[2].get_debug_state().execution_plans) == 1
