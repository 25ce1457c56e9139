"""kiln-x86's quantized linear methods, plugged into Kiln's ``quant_config`` path.

``X86Platform.get_quant_config(method, config)`` returns Kiln's configs
(``kiln.model_executor.layers.quantization``) with these methods:

- "gguf": ``X86GGUFLinearMethod`` keeps each GGUF weight in ``kiln_x86.quant``'s layout
  (``pack``) and multiplies with its weight-only kernels (``matmul``, ``embedding``). Block
  formats the kernels lack fall back to Kiln's reference (dequantize per call).
- "int8": ``X86Int8LinearMethod``, torch's weight-only int8 CPU kernel
  (``aten._weight_int8pack_mm``) on Kiln's per-channel int8 weights; with the x86 section's
  ``int8_activations`` (the default), ``X86Int8ActivationsLinearMethod``: bfloat16 layers' weights
  kept only in ``kiln_x86.gemv``'s tiled layout (as Q8_0 blocks: the channel's scale in every
  block) and multiplied by its int8 kernels, activations rounded to int8 per block of 32.
- "int4": ``X86Int4LinearMethod``, torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``)
  on Kiln's group-wise int4 weights, repacked once into its layout.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from kiln.plugin_api import (
    INT4_GROUP_SIZE,
    GGUFLinearMethod,
    GGUFWeight,
    Int4LinearMethod,
    Int8LinearMethod,
    unpack_int4,
)
from kiln_x86 import gemv, quant


class X86GGUFLinearMethod(GGUFLinearMethod):
    """GGUF weights through ``kiln_x86.quant`` (the reference for other block formats)."""

    int8_max_rows = 0
    """Rows up to which the activations are rounded to int8 (``quant.matmul``): none."""

    def pack(self, raw: torch.Tensor, qtype: Any, out_features: int, in_features: int) -> Any:
        if qtype not in quant.SUPPORTED_TYPES:
            return super().pack(raw, qtype, out_features, in_features)
        return quant.pack(raw, qtype, out_features, in_features)

    def matmul(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        if isinstance(packed, GGUFWeight) or x.dtype not in (torch.float32, torch.bfloat16):
            return super().matmul(x, packed)
        return quant.matmul(x, packed, self.int8_max_rows)

    def embed(self, input_ids: torch.Tensor, packed: Any) -> torch.Tensor:
        if isinstance(packed, GGUFWeight):
            return super().embed(input_ids, packed)
        return quant.embedding(input_ids, packed)


class X86GGUFInt8ActivationsLinearMethod(X86GGUFLinearMethod):
    """GGUF weights with the activations rounded to int8 (the x86 section's ``int8_activations``):
    where the CPU has AVX512-VNNI or AVX2, each weight is kept only in ``kiln_x86.gemv``'s tiled
    layout and every matmul, whatever its row count, runs its int8 kernels (the same result per
    row); not exact. Elsewhere the exact method's kernels: rounding only some row counts would
    make a prompt's result depend on whether its prefix was cached."""

    def pack(self, raw: torch.Tensor, qtype: Any, out_features: int, in_features: int) -> Any:
        if qtype not in quant.SUPPORTED_TYPES or not gemv.available():
            return super().pack(raw, qtype, out_features, in_features)
        return quant.pack(raw, qtype, out_features, in_features, tiled=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        # A layer that is one tiled weight gets kiln_x86.ops' direct ``linear`` kernel call.
        parts = getattr(layer, "gguf_parts", None)
        if parts is not None and len(parts) == 1 and isinstance(parts[0][1], gemv.TiledWeight):
            # Not a tensor or module, which is all nn.Module's attribute typing allows.
            layer.x86_tiled = parts[0][1]  # type: ignore[assignment]


class X86Int8LinearMethod(Int8LinearMethod):
    """int8 per output channel through ``aten._weight_int8pack_mm`` (scales kept in the
    model's dtype, which the kernel wants)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = cast(torch.Tensor, layer.weight).dtype
        super().process_weights_after_loading(layer)
        layer.scales = cast(torch.Tensor, layer.scales).to(dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            return super().apply(layer, x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        scales = layer.scales if layer.scales.dtype == x.dtype else layer.scales.to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, scales)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


class X86Int8ActivationsLinearMethod(X86Int8LinearMethod):
    """int8 per output channel with the activations rounded to int8 (the x86 section's
    ``int8_activations``): a bfloat16 layer's weights go into ``kiln_x86.gemv``'s tiled layout as
    Q8_0 blocks (``u = q + 128``, the channel's scale in each block of 32) and every matmul runs
    its int8 kernels (VNNI or AVX2; AMX for prefill where present), whatever its row count, with
    the same result per row; the layer then holds only the tiled copy and gets ``kiln_x86.ops``'
    direct ``linear`` call. Not exact (as the GGUF path's int8 activations). float32 layers (the
    mode for comparing token for token), CPUs without the kernel, input sizes not a multiple of
    32 and scales outside float16's normal range (where a Q8_0 scale would lose bits) keep the
    exact method."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = cast(torch.Tensor, layer.weight).dtype
        super().process_weights_after_loading(layer)
        qweight, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        if dtype != torch.bfloat16 or qweight.shape[1] % gemv.BLOCK or not gemv.available():
            return
        scales32 = scales.float()
        if not bool(((scales32 >= 2.0**-14) & (scales32 <= 65504.0)).all()):
            return
        u = (qweight.to(torch.int16) + 128).to(torch.uint8).numpy()
        per_block = scales32.numpy()[:, None].repeat(qweight.shape[1] // gemv.BLOCK, axis=1)
        tiled = gemv.pack(u, per_block, None, gemv.Q.Q8_0)
        del layer.qweight, layer.scales
        # Not a tensor or module, which is all nn.Module's attribute typing allows.
        layer.x86_tiled = tiled  # type: ignore[assignment]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        tiled = layer.__dict__.get("x86_tiled")
        if tiled is None:
            return super().apply(layer, x, bias)
        out = quant.matmul(x, tiled)
        return out if bias is None else out + bias


class X86Int4LinearMethod(Int4LinearMethod):
    """int4 groups through ``aten._weight_int4pack_mm_for_cpu``; the weight is kept only in
    that kernel's layout (``int4_packed``) and ``scales_and_zeros`` [in / group, out, 2]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = cast(torch.Tensor, layer.weight).dtype
        super().process_weights_after_loading(layer)
        # Int4LinearMethod's buffers.
        qweight = cast(torch.Tensor, layer.qweight)
        scales = cast(torch.Tensor, layer.scales)
        zeros = cast(torch.Tensor, layer.zeros)
        values = unpack_int4(qweight).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1)
        scales_and_zeros = scales_and_zeros.to(dtype).contiguous()
        del layer.qweight, layer.scales, layer.zeros
        layer.register_buffer("int4_packed", packed)
        layer.register_buffer("scales_and_zeros", scales_and_zeros)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(dtype), layer.int4_packed, INT4_GROUP_SIZE, layer.scales_and_zeros.to(dtype)
        ).to(x.dtype)  # .to: no-ops in the model's dtype
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias
