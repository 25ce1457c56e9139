"""The Attention layer, KV cache binding, backend validation and the forward context."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.forward_context import (
    ForwardContext,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from kiln.model_executor.layers.attention import (
    Attention,
    AttentionBackend,
    bind_kv_cache,
    get_attention_layers,
    get_attn_backend,
    resolve_attn_backend,
    validate_attention_backend,
)
from kiln.model_executor.layers.attention.backends.cpu import (
    CPUAttentionBackend,
    CPUAttentionImpl,
)

CPU_PATH = "kiln.model_executor.layers.attention.backends.cpu.CPUAttentionBackend"


class TwoLayers(nn.Module):
    def __init__(self, names: tuple[str, str] = ("layers.0.attn", "layers.1.attn")) -> None:
        super().__init__()
        self.attns = nn.ModuleList(Attention(4, 8, 0.5, 2, prefix=name) for name in names)


# -- forward context ------------------------------------------------------------------------------


def test_forward_context_outside_block_raises() -> None:
    assert not is_forward_context_available()
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()


def test_forward_context_nests_and_restores() -> None:
    outer, inner = ForwardContext("outer", num_tokens=3), ForwardContext("inner")
    with set_forward_context(outer):
        assert get_forward_context() is outer
        with set_forward_context(inner):
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    assert not is_forward_context_available()


def test_forward_context_is_reset_after_an_exception() -> None:
    with pytest.raises(KeyError), set_forward_context(ForwardContext(None)):
        raise KeyError("boom")
    assert not is_forward_context_available()


# -- the layer ------------------------------------------------------------------------------------


def test_layer_takes_the_configs_backend_and_outside_one_the_reference() -> None:
    """Inside a config the layer takes the backend the platform named there; outside one (a
    layer or model built by hand) the reference cpu backend, whatever platform is installed:
    building a layer never selects a platform."""
    from kiln.config import DeviceConfig, KilnConfig, set_current_config
    from kiln.model_executor.layers.attention.backends.cpu_batch_invariant import (
        CPUBatchInvariantAttentionBackend,
    )

    layer = Attention(4, 8, 0.5, 2, prefix="x")
    assert layer.backend is get_attn_backend() is CPUAttentionBackend
    assert isinstance(layer.impl, CPUAttentionImpl)
    named = (
        f"{CPUBatchInvariantAttentionBackend.__module__}."
        f"{CPUBatchInvariantAttentionBackend.__qualname__}"
    )
    with set_current_config(KilnConfig(device=DeviceConfig(attention_backend=named))):
        layer = Attention(4, 8, 0.5, 2, prefix="y")
    assert layer.backend is CPUBatchInvariantAttentionBackend
    assert "num_kv_heads=2" in repr(layer)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size", [(9, 2, 8), (4, 0, 8), (0, 1, 8), (4, 2, 0)]
)
def test_layer_rejects_bad_head_counts(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        Attention(num_heads, head_size, 1.0, num_kv_heads)


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_layer_rejects_a_non_positive_soft_cap(cap: float) -> None:
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(4, 8, 1.0, 2, logits_soft_cap=cap)


def test_layer_outside_forward_context_raises() -> None:
    layer = Attention(4, 8, 0.5, 2)
    with pytest.raises(RuntimeError, match="no forward context"):
        layer(torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16))


def test_layer_dummy_run_returns_zeros() -> None:
    layer = Attention(4, 8, 0.5, 2)
    with set_forward_context(ForwardContext(attn_metadata=None, num_tokens=5)):
        out = layer(torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16))
    assert out.shape == (5, 32) and bool((out == 0).all())


def test_layer_without_kv_cache_raises() -> None:
    layer = Attention(4, 8, 0.5, 2, prefix="model.layers.3.attn")
    with (
        set_forward_context(ForwardContext(attn_metadata=object())),
        pytest.raises(RuntimeError, match="model.layers.3.attn"),
    ):
        layer(torch.zeros(1, 32), torch.zeros(1, 16), torch.zeros(1, 16))


def test_bind_kv_cache_by_layer_name() -> None:
    model = TwoLayers()
    layers = get_attention_layers(model)
    assert list(layers) == ["layers.0.attn", "layers.1.attn"]
    caches = {
        name: torch.zeros(CPUAttentionBackend.get_kv_cache_shape(4, 16, 2, 8)) for name in layers
    }
    bind_kv_cache(model, caches)
    assert all(layers[name].kv_cache is caches[name] for name in layers)
    assert "kv_cache" not in str(model.state_dict().keys())


def test_bind_kv_cache_mismatch_names_both_sides() -> None:
    model = TwoLayers()
    caches = {"layers.0.attn": torch.zeros(1), "layers.9.attn": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"layers\.1\.attn.*layers\.9\.attn"):
        bind_kv_cache(model, caches)


def test_duplicate_layer_names_are_refused() -> None:
    with pytest.raises(ValueError, match="two Attention layers"):
        get_attention_layers(TwoLayers(("same", "same")))


# -- backend validation ---------------------------------------------------------------------------


def test_resolve_cpu_backend_by_dotted_path() -> None:
    assert resolve_attn_backend(CPU_PATH) is CPUAttentionBackend


def test_validation_refuses_non_backends() -> None:
    with pytest.raises(TypeError, match="must subclass AttentionBackend"):
        validate_attention_backend(object)
    with pytest.raises(ImportError):
        resolve_attn_backend("kiln.no_such_module.Backend")


def test_validation_refuses_a_missing_method() -> None:
    class NoShape(AttentionBackend):
        get_name = CPUAttentionBackend.get_name
        get_impl_cls = CPUAttentionBackend.get_impl_cls
        get_metadata_builder_cls = CPUAttentionBackend.get_metadata_builder_cls

    with pytest.raises(TypeError, match="get_kv_cache_shape"):
        validate_attention_backend(NoShape)


def test_validation_refuses_a_wrong_impl_signature() -> None:
    class BadImpl(CPUAttentionImpl):
        def forward(self, layer, query, key, value):  # type: ignore[override]
            raise AssertionError

    class BadBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls() -> type:
            return BadImpl

    with pytest.raises(TypeError, match="BadImpl.forward"):
        validate_attention_backend(BadBackend)


def test_validation_refuses_an_impl_without_logits_soft_cap() -> None:
    class OldImpl(CPUAttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None):  # type: ignore[override]
            super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)

    class OldBackend(CPUAttentionBackend):
        @staticmethod
        def get_impl_cls() -> type:
            return OldImpl

    with pytest.raises(TypeError, match="OldImpl.__init__"):
        validate_attention_backend(OldBackend)


def test_validation_refuses_a_too_small_cache_shape() -> None:
    class HalfCache(CPUAttentionBackend):
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (num_blocks, block_size, num_kv_heads, head_size)

    with pytest.raises(TypeError, match="no room for K and V"):
        validate_attention_backend(HalfCache)
