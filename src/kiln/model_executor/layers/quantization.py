"""Weights kept quantized in memory: Kiln's reference methods for "gguf", "int8" and "int4".

Contract (what ``Platform.get_quant_config(method, config)`` returns, and what a platform's
kernels plug into):

- ``GGUFQuantConfig`` gives every linear layer, the token embedding and the LM head a
  ``GGUFLinearMethod``. The GGUF loader then hands each of their weights, instead of a
  dequantized tensor, a ``GGUFWeight``: the tensor's raw block bytes as ``uint8``
  ``[out_features, in_features // block_size * bytes_per_block]`` (rows in the same order as a
  dense ``weight[out, in]``; llama Q/K rows already un-permuted) and its
  ``gguf.GGMLQuantizationType``. Tensors the file stores as floats (norms, sometimes a linear)
  arrive dense. Once every shard of a fused layer is in, consecutive shards of one type are
  joined row-wise and handed to ``pack(raw, qtype, out_features, in_features)`` once; ``apply``
  runs ``matmul(x [..., in], packed) -> [..., out]`` (x's dtype) per part and ``embedding``
  runs ``embed(ids, packed) -> [T, in]``. A platform subclasses ``GGUFLinearMethod``, overrides
  those three with its kernels, and returns ``GGUFQuantConfig(its_method_class)``.
- ``Int8QuantConfig`` / ``Int4QuantConfig`` quantize a float model's linear layers on load
  (``--quantization int8|int4``): the layer loads a dense ``weight`` as usual, then
  ``process_weights_after_loading`` replaces it with int8 per output channel (symmetric, scale =
  max |w| / 127) or int4 in groups of ``INT4_GROUP_SIZE`` along the input (asymmetric:
  ``w = (q - 8) * scale + zero``, ``q`` in 0..15). Embeddings and the LM head stay dense.

The reference methods here dequantize on every call (GGUF with ``loader.dequant``): correct and
compact in memory, slow. Platforms that support nothing never see them; they exist for platforms
to build on and for tests to compare against. This module knows nothing about models or files.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kiln.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    WeightLoader,
    set_weight_attrs,
)

INT4_GROUP_SIZE = 32
"""Input features sharing one int4 scale and zero."""


@dataclass(frozen=True)
class GGUFWeight:
    """One GGUF tensor's raw blocks.

    Attributes:
        data: ``uint8`` [rows, row_bytes]; each row is one output feature's whole blocks.
        qtype: the block format.
        shape: the logical ``(rows, columns)``, i.e. ``(out_features, in_features)``.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]


class _GGUFLayer(Protocol):
    """What ``GGUFLinearMethod`` keeps on its layer (an ``nn.Module``, whose attribute typing
    knows only tensors and modules); platforms read ``gguf_parts``."""

    gguf_input_size: int
    gguf_sizes: list[int]
    gguf_dtype: torch.dtype
    gguf_shards: list[GGUFWeight | torch.Tensor | None] | None
    """One entry per fused part until ``process_weights_after_loading``, then None."""
    gguf_parts: list[tuple[GGMLQuantizationType | None, Any]]
    """(qtype, packed) per run of parts of one type; qtype None: a dense tensor."""


class _Int8Layer(Protocol):
    """The buffers ``Int8LinearMethod`` leaves on its layer."""

    qweight: torch.Tensor
    scales: torch.Tensor


class _Int4Layer(Protocol):
    """The buffers ``Int4LinearMethod`` leaves on its layer."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def _shard_index(layer: nn.Module, shard_id: Any, num_shards: int) -> int:
    if shard_id is None:
        index = 0
    elif isinstance(shard_id, str):
        names = getattr(layer, "_SHARDS", ())
        index = names.index(shard_id) if shard_id in names else -1
    else:
        index = shard_id if isinstance(shard_id, int) else -1
    if not 0 <= index < num_shards or (shard_id is None and num_shards > 1):
        raise ValueError(
            f"{getattr(layer, 'prefix', '') or type(layer).__name__}: shard_id={shard_id!r} "
            f"does not name one of its {num_shards} part(s)"
        )
    return index


class GGUFLinearMethod(LinearMethodBase):
    """GGUF blocks kept as loaded; the reference dequantizes them on every call.

    Subclasses override ``pack``, ``matmul`` and ``embed`` (see the module docstring).
    """

    # -- the kernel seam -----------------------------------------------------------------------
    def pack(
        self,
        raw: torch.Tensor,
        qtype: GGMLQuantizationType,
        out_features: int,
        in_features: int,
    ) -> Any:
        """``raw`` uint8 [out_features, row_bytes] -> the object ``matmul``/``embed`` take."""
        return GGUFWeight(raw.contiguous(), qtype, (out_features, in_features))

    def matmul(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        """``x`` [..., in_features] -> [..., out_features] in ``x``'s dtype."""
        return F.linear(x, _dequantize(packed.data, packed.qtype).to(x.dtype))

    def embed(self, input_ids: torch.Tensor, packed: Any) -> torch.Tensor:
        """Rows ``input_ids`` [T] -> [T, in_features] (any float dtype)."""
        return _dequantize(packed.data[input_ids], packed.qtype)

    # -- LinearMethodBase ----------------------------------------------------------------------
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: Any,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        state = cast(_GGUFLayer, layer)
        state.gguf_input_size = input_size
        state.gguf_sizes = list(output_partition_sizes)
        state.gguf_dtype = params_dtype
        state.gguf_shards = [None] * len(state.gguf_sizes)
        state.gguf_parts = []
        # Empty until loaded: its shape depends on the file's block format.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": functools.partial(self._load, layer)})
        layer.register_parameter("weight", weight)

    def _load(
        self,
        layer: nn.Module,
        param: torch.Tensor,
        loaded: GGUFWeight | torch.Tensor,
        shard_id: Any = None,
    ) -> None:
        state = cast(_GGUFLayer, layer)
        index = _shard_index(layer, shard_id, len(state.gguf_sizes))
        shape = tuple(loaded.shape)
        expected = (state.gguf_sizes[index], state.gguf_input_size)
        if shape != expected:
            raise ValueError(
                f"{getattr(layer, 'prefix', '')}: checkpoint tensor of shape {shape} does not "
                f"fit part {index} of shape {expected}"
            )
        assert state.gguf_shards is not None, "loaded after process_weights_after_loading"
        state.gguf_shards[index] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state = cast(_GGUFLayer, layer)
        assert state.gguf_shards is not None, "processed twice"
        groups: list[tuple[GGMLQuantizationType | None, list[torch.Tensor], int]] = []
        for index, shard in enumerate(state.gguf_shards):
            if shard is None:
                raise ValueError(f"{getattr(layer, 'prefix', '')}: part {index} was not loaded")
            if isinstance(shard, GGUFWeight):
                qtype, data = shard.qtype, shard.data
            else:
                qtype, data = None, shard.to(state.gguf_dtype)
            rows = state.gguf_sizes[index]
            if groups and groups[-1][0] == qtype:
                groups[-1][1].append(data)
                groups[-1] = (qtype, groups[-1][1], groups[-1][2] + rows)
            else:
                groups.append((qtype, [data], rows))
        parts: list[tuple[GGMLQuantizationType | None, Any]] = []
        for qtype, datas, rows in groups:
            data = torch.cat(datas) if len(datas) > 1 else datas[0]
            if qtype is None:
                parts.append((None, data.contiguous()))
            else:
                parts.append((qtype, self.pack(data, qtype, rows, state.gguf_input_size)))
        state.gguf_parts = parts
        state.gguf_shards = None
        del layer.weight
        for i, (_qtype, packed) in enumerate(parts):
            # Tensors the pack keeps are buffers, so that moving and measuring the model sees them.
            for j, tensor in enumerate(tensors_in(packed)):
                layer.register_buffer(f"gguf_part{i}_{j}", tensor, persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        outs = [
            F.linear(x, packed) if qtype is None else self.matmul(x, packed)
            for qtype, packed in cast(_GGUFLayer, layer).gguf_parts
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        state = cast(_GGUFLayer, layer)
        (qtype, packed), *rest = state.gguf_parts
        if rest:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: an embedding has one part")
        if qtype is None:
            return F.embedding(input_ids, packed)
        return self.embed(input_ids, packed).to(state.gguf_dtype)


def _dequantize(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    from kiln.model_executor.loader.dequant import dequantize

    return torch.from_numpy(dequantize(np.ascontiguousarray(data.numpy()), qtype))


def tensors_in(obj: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors an opaque packed weight holds: itself, or (``depth`` levels down) the items
    of a list, tuple or dict, or the attributes of a plain object (a dataclass, say)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or isinstance(obj, (enum.Enum, type, str, bytes, int, float)):
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif not isinstance(obj, (list, tuple)):
        obj = list(getattr(obj, "__dict__", {}).values())
    return [t for item in obj for t in tensors_in(item, depth - 1)]


class _DenseThenQuantize(UnquantizedLinearMethod):
    """Loads a dense ``weight`` like ``UnquantizedLinearMethod``; quantizes it after loading."""


class Int8LinearMethod(_DenseThenQuantize):
    """int8 per output channel: buffers ``qweight`` int8 [out, in] and ``scales`` float32 [out].

    The reference dequantizes per call; subclasses override ``apply``.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales = quantize_int8(cast(torch.Tensor, layer.weight).detach())
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scales", scales)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        buffers = cast(_Int8Layer, layer)
        weight = dequantize_int8(buffers.qweight, buffers.scales)
        return F.linear(x, weight.to(x.dtype), bias)


class Int4LinearMethod(_DenseThenQuantize):
    """int4 in groups of ``INT4_GROUP_SIZE``: buffers ``qweight`` uint8 [out, in / 2] (element
    ``2j`` in the low nibble, ``2j + 1`` in the high one), ``scales`` and ``zeros`` float32
    [out, in / group].

    The reference dequantizes per call; subclasses override ``apply``.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, zeros = quantize_int4(cast(torch.Tensor, layer.weight).detach())
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("scales", scales)
        layer.register_buffer("zeros", zeros)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        buffers = cast(_Int4Layer, layer)
        weight = dequantize_int4(buffers.qweight, buffers.scales, buffers.zeros)
        return F.linear(x, weight.to(x.dtype), bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (int8 [out, in], float32 scales [out]), symmetric per row."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales[:, None]


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (uint8 [out, in / 2], scales, zeros [out, in / group_size]).

    Raises:
        ValueError: ``in`` is not a multiple of ``group_size``.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {in_features}")
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features)
    qweight = q[:, 0::2] | (q[:, 1::2] << 4)
    return qweight.contiguous(), scales, low + 8 * scales


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in / 2] -> uint8 [out, in] values 0..15."""
    return torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    q = unpack_int4(qweight).float().reshape(*scales.shape, -1)
    return ((q - 8) * scales[..., None] + zeros[..., None]).reshape(qweight.shape[0], -1)


class GGUFQuantConfig(QuantizationConfig):
    """Every linear layer, the token embedding and the LM head keep their GGUF blocks."""

    name = "gguf"

    def __init__(self, method_cls: type[GGUFLinearMethod] = GGUFLinearMethod) -> None:
        self.method_cls = method_cls

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return self.method_cls()


class Int8QuantConfig(QuantizationConfig):
    """Linear layers in int8 per output channel; embeddings and the LM head dense."""

    name = "int8"

    def __init__(self, method_cls: type[Int8LinearMethod] = Int8LinearMethod) -> None:
        self.method_cls = method_cls

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return self.method_cls() if isinstance(layer, LinearBase) else None


class Int4QuantConfig(QuantizationConfig):
    """Linear layers in int4 groups (those whose input size divides into groups); embeddings and
    the LM head dense."""

    name = "int4"

    def __init__(self, method_cls: type[Int4LinearMethod] = Int4LinearMethod) -> None:
        self.method_cls = method_cls

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase) or layer.input_size % INT4_GROUP_SIZE:
            return None
        return self.method_cls()


def reference_quant_config(method: str) -> QuantizationConfig:
    """Kiln's reference config for ``method``.

    Raises:
        ValueError: ``method`` is not "gguf", "int8" or "int4".
    """
    configs: dict[str, Callable[[], QuantizationConfig]] = {
        "gguf": GGUFQuantConfig,
        "int8": Int8QuantConfig,
        "int4": Int4QuantConfig,
    }
    if method not in configs:
        raise ValueError(f"model.quantization={method!r} is invalid; allowed: {list(configs)}")
    return configs[method]()


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total


__all__ = [
    "INT4_GROUP_SIZE",
    "GGUFLinearMethod",
    "GGUFQuantConfig",
    "GGUFWeight",
    "Int4LinearMethod",
    "Int4QuantConfig",
    "Int8LinearMethod",
    "Int8QuantConfig",
    "dequantize_int4",
    "dequantize_int8",
    "model_weight_bytes",
    "quantize_int4",
    "quantize_int8",
    "reference_quant_config",
    "tensors_in",
    "unpack_int4",
]
