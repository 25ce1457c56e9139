"""Linear layers with a quantization hook and per-parameter weight loaders.

Contract: a linear layer computes ``y = x @ W^T + b`` for ``x`` [num_tokens, input_size]. How ``W``
is stored and multiplied is its ``quant_method``'s business (a ``LinearMethodBase``): the method
creates the layer's parameters (``create_weights``) and runs the product (``apply``). The default,
``UnquantizedLinearMethod``, keeps a dense ``weight`` [output_size, input_size] and calls
``F.linear``. A platform that keeps weights quantized supplies a ``QuantizationConfig``
(``Platform.get_quant_config``) whose ``get_linear_method(layer, prefix)`` returns its own method
(its own parameters, each with a ``weight_loader``); the token embedding and LM head ask it too
(``kiln.model_executor.layers.vocab_embedding``), and a method that accepts them implements
``embedding``. Kiln's reference methods are in ``kiln.model_executor.layers.quantization``.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``. Fused layers use
``shard_id`` to place one checkpoint tensor inside the fused parameter: ``QKVParallelLinear`` takes
``"q"``, ``"k"``, ``"v"``; ``MergedColumnParallelLinear`` takes the index of the merged output
(``0`` = gate, ``1`` = up). Fusing turns three (or two) matmuls into one, which is what the hot
path wants.

Tensor parallelism: a layer built inside ``kiln.distributed.parallel_state.set_tp_group`` keeps
that group's rank and size. Column-parallel layers hold ``1 / tp_size`` of each fused output part
(rank ``r`` the ``r``-th slice; attention heads go by whole KV groups, as evenly as they split, and
key/value heads are replicated over ranks when there are fewer of them than ranks) and return their
slice; row-parallel layers hold the matching slice of the input dimension and all-reduce their
partial sums through the platform's communicator (rank 0 holds the bias, the other ranks zeros).
The collectives run outside the dispatched op, so a provider's ``linear`` implementation computes
only its rank's product. Weight loaders take the whole checkpoint tensor and copy this rank's
slice. Quantized methods are not sharded: with more than one rank a ``quant_config`` that gives a
layer a method is refused (``ValueError``; use dense weights, ``--quantization none``).

Every layer here is the custom op ``"linear"``: a provider may register a faster implementation
for all of them at once. A layer built under a config with ``model.batch_invariant`` has
``batch_invariant = True``: an implementation that serves it must give each row the same result
whatever the other rows are (how many, and which). This module knows nothing about models,
checkpoints or file formats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.parallel_state import divide, tp_group_for
from kiln.model_executor.custom_op import CustomOp, register_op

WeightLoader = Callable[..., None]


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (``weight_loader``, ``output_dim``...) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
) -> None:
    """Copy a whole checkpoint tensor into ``param`` (same shape; dtype/device converted).

    Raises:
        ValueError: a ``shard_id`` was given, or the shapes differ.
    """
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused; got {shard_id=}")
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit parameter of "
            f"shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def batch_invariant_enabled() -> bool:
    """Whether the model being built (``kiln.config.set_current_config``) is batch-invariant."""
    from kiln.config import get_current_config

    config = get_current_config()
    return config is not None and config.model.batch_invariant


def check_unsharded_method(method: object, tp_size: int, prefix: str) -> None:
    """Refuse a quantized method on a sharded layer (its storage is not split per rank).

    Raises:
        ValueError: a method given with ``tp_size > 1``; names ``model.quantization``.
    """
    if tp_size > 1 and not isinstance(method, (type(None), UnquantizedLinearMethod)):
        raise ValueError(
            f"{prefix or 'layer'}: model.quantization keeps weights quantized "
            f"({type(method).__name__}), which tensor parallelism does not shard; with "
            f"parallel.tensor_parallel_size={tp_size} allowed: 'auto' or 'none' "
            "(--quantization none, dense weights)"
        )


class LinearMethodBase(ABC):
    """How a linear layer stores its weight and computes its product."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register the layer's weight parameters on ``layer``.

        Args:
            input_size: input features (of this rank's shard).
            output_partition_sizes: output features of each fused part (one entry when unfused),
                in the order they are concatenated.
            params_dtype: the model's compute dtype.
            weight_loader: the layer's loader; set it as ``weight_loader`` on every parameter
                that is loaded from a checkpoint tensor.
        """

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` [num_tokens, input_size] -> [num_tokens, output_size]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repack weights once every shard is loaded (a quantized layout, say). Default: no-op."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` [T] of the weight -> [T, input_size] in the model's dtype; only for
        methods that a ``QuantizationConfig`` gives a token embedding."""
        raise NotImplementedError(f"{type(self).__name__} does not serve embeddings")


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight [output_size, input_size] in the compute dtype; ``F.linear``."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"weight_loader": weight_loader, "output_dim": 0})
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)


class QuantizationConfig(ABC):
    """What a quantization plugin supplies: the linear method of each layer.

    ``name`` is the ``model.quantization`` method it implements ("gguf", "int8", "int4"); with
    "gguf" the GGUF loader hands the methods' ``weight_loader`` a ``GGUFWeight`` (raw blocks)
    for every quantized tensor instead of a dequantized one.
    """

    name: str = ""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the layer named ``prefix`` (a ``LinearBase``, or a
        ``VocabParallelEmbedding`` / ``ParallelLMHead``), or None to keep it unquantized."""


@register_op("linear")
class LinearBase(CustomOp):
    """Base of every linear layer.

    Args:
        input_size: input features.
        output_partition_sizes: output features of each fused part.
        bias: whether the layer has a bias [output_size].
        params_dtype: parameter dtype (the model's compute dtype).
        quant_config: picks the linear method; None -> ``UnquantizedLinearMethod``.
        prefix: the layer's name in the model (``model.layers.0.self_attn.qkv_proj``).
    """

    def __init__(
        self,
        input_size: int,
        output_partition_sizes: Sequence[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        params_dtype = params_dtype or torch.get_default_dtype()
        self.input_size = input_size
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size = sum(self.output_partition_sizes)
        self.prefix = prefix
        # Read once at build time: providers check it per call (see the module docstring).
        self.batch_invariant = batch_invariant_enabled()
        method = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size, self.output_partition_sizes, params_dtype, self.weight_loader
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size, dtype=params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0})
        else:
            self.register_parameter("bias", None)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, input_size] -> [num_tokens, output_size]
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_partition_sizes}, "
            f"bias={self.bias is not None}, method={type(self.quant_method).__name__}"
        )

    @classmethod
    def make_examples(cls, generator: torch.Generator) -> list[tuple[CustomOp, tuple, dict]]:
        layers: list[LinearBase] = [
            ReplicatedLinear(64, 48),
            QKVParallelLinear(64, 16, 4, 2, bias=True),
            MergedColumnParallelLinear(64, [80, 80]),
            RowParallelLinear(64, 32, bias=True, params_dtype=torch.bfloat16),
        ]
        examples: list[tuple[CustomOp, tuple, dict]] = []
        for layer in layers:
            for param in layer.parameters():
                param.data.copy_(0.1 * torch.randn(param.shape, generator=generator))
            dtype = cast(torch.Tensor, layer.weight).dtype
            for num_tokens in (1, 9):
                x = torch.randn(num_tokens, 64, generator=generator).to(dtype)
                examples.append((layer, (x,), {}))
        return examples


class ReplicatedLinear(LinearBase):
    """A linear layer whose whole weight lives on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, [output_size], bias, params_dtype, quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks (each rank computes a slice of the features).

    ``output_sizes`` are the whole model's; this rank holds ``1 / tp_size`` of each part.
    Fused subclasses concatenate several outputs; their shards are laid out in
    ``output_partition_sizes`` order along dimension 0 of every parameter that has
    ``output_dim`` (weight and bias).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        tp_size: int | None = None,
    ) -> None:
        group = tp_group_for(tp_size)
        self.tp_group, self.tp_rank, self.tp_size = group, group.rank, group.world_size
        local_sizes = self._shard_sizes(list(output_sizes), prefix)
        super().__init__(input_size, local_sizes, bias, params_dtype, quant_config, prefix)
        check_unsharded_method(self.quant_method, self.tp_size, prefix)

    def _shard_sizes(self, output_sizes: list[int], prefix: str) -> list[int]:
        """This rank's size of each fused part (an even split)."""
        return [
            divide(size, self.tp_size, f"{prefix or 'layer'} output size") for size in output_sizes
        ]

    def _shard_start(self, shard_index: int) -> int:
        """Where this rank's slice of fused part ``shard_index`` starts in the checkpoint
        tensor (along the output dimension)."""
        return self.tp_rank * self.output_partition_sizes[shard_index]

    def _shard_offset(self, shard_index: int) -> tuple[int, int]:
        """(offset, size) of fused part ``shard_index`` along the output dimension."""
        sizes = self.output_partition_sizes
        return sum(sizes[:shard_index]), sizes[shard_index]

    def _load_shard(self, param: torch.Tensor, loaded_weight: torch.Tensor, index: int) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            # A parameter shared by every shard (a per-tensor scale, say): loaded whole.
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self._shard_offset(index)
        if self.tp_size > 1:
            # The checkpoint holds the whole part: keep this rank's slice.
            loaded_weight = loaded_weight.narrow(output_dim, self._shard_start(index), size)
        target = param.data.narrow(output_dim, offset, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"{self.prefix or type(self).__name__}: shard {index} of shape "
                f"{tuple(loaded_weight.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded_weight)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is None and self.tp_size > 1 and len(self.output_partition_sizes) == 1:
            self._load_shard(param, loaded_weight, 0)
            return
        default_weight_loader(param, loaded_weight, shard_id)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate and up projections).

    ``weight_loader(param, w, shard_id)`` with ``shard_id`` the index into ``output_sizes``.
    """

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_partition_sizes):
            raise ValueError(
                f"{self.prefix}: shard_id must be in range({len(self.output_partition_sizes)}), "
                f"got {shard_id!r}"
            )
        self._load_shard(param, loaded_weight, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused into one matmul.

    Output layout (this rank's heads): ``[q (num_heads * head_size) | k (num_kv_heads *
    head_size) | v (same)]``. With at least as many key/value heads as ranks, each rank holds
    whole KV groups (a key/value head and its query heads), as evenly as they go: the first
    ``total_num_kv_heads % tp_size`` ranks one group more (``kv_head_start`` and ``q_head_start``
    say where this rank's heads begin). With fewer, each rank holds one key/value head, shared by
    ``tp_size / total_num_kv_heads`` ranks (replicated), and an even share of the query heads.
    ``weight_loader(param, w, shard_id)`` with ``shard_id`` in ``"q"``, ``"k"``, ``"v"``.
    """

    _SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        tp_size: int | None = None,
    ) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        q_size = total_num_heads * head_size
        kv_size = self.total_num_kv_heads * head_size
        super().__init__(
            hidden_size,
            [q_size, kv_size, kv_size],
            bias,
            params_dtype,
            quant_config,
            prefix,
            tp_size,
        )

    def _shard_sizes(self, output_sizes: list[int], prefix: str) -> list[int]:
        tp, rank = self.tp_size, self.tp_rank
        total_heads, total_kv = self.total_num_heads, self.total_num_kv_heads
        group = divide(total_heads, total_kv, "num_attention_heads over num_key_value_heads")
        if total_kv >= tp:
            # Whole KV groups per rank, as even as they go (9 heads over 3 KV heads at tp=2:
            # 2 groups then 1), so a model whose head count tp does not divide still splits.
            self.num_kv_heads = total_kv // tp + (1 if rank < total_kv % tp else 0)
            self.kv_head_start = rank * (total_kv // tp) + min(rank, total_kv % tp)
            self.num_heads = self.num_kv_heads * group
            self.q_head_start = self.kv_head_start * group
        else:
            # Fewer KV heads than ranks: each rank holds one, shared by tp / total_kv ranks.
            replicas = divide(tp, total_kv, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = rank // replicas
            self.num_heads = divide(total_heads, tp, "num_attention_heads")
            self.q_head_start = rank * self.num_heads
        kv_size = self.num_kv_heads * self.head_size
        return [self.num_heads * self.head_size, kv_size, kv_size]

    def _shard_start(self, shard_index: int) -> int:
        head = self.q_head_start if shard_index == 0 else self.kv_head_start
        return head * self.head_size

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self._SHARDS:
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        self._load_shard(param, loaded_weight, self._SHARDS.index(shard_id))


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; the partial products are summed over ranks (an
    all-reduce through the group's communicator); only rank 0 adds the bias.

    ``input_size`` is the whole model's; this rank holds ``input_size / tp_size`` columns, or
    the ``input_shard=(offset, size)`` given (an attention output projection takes the columns
    of its rank's heads, which need not split evenly: see ``QKVParallelLinear``).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        tp_size: int | None = None,
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        group = tp_group_for(tp_size)
        self.tp_group, self.tp_rank, self.tp_size = group, group.rank, group.world_size
        if input_shard is None:
            size = divide(input_size, self.tp_size, f"{prefix or 'layer'} input size")
            input_shard = (self.tp_rank * size, size)
        self.input_start, local_input = input_shard
        super().__init__(local_input, [output_size], bias, params_dtype, quant_config, prefix)
        check_unsharded_method(self.quant_method, self.tp_size, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dispatched op (any provider's) computes this rank's partial product; the sum over
        # ranks stays here, so providers need not know about tensor parallelism.
        out = super().forward(x)  # [num_tokens, output_size], partial when tp_size > 1
        return out if self.tp_size == 1 else self.tp_group.all_reduce(out)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None
    ) -> None:
        if self.tp_size > 1 and param is self.bias:
            # Added once to the sum: rank 0 holds it, the other ranks add zeros.
            default_weight_loader(param, loaded_weight if self.tp_rank == 0 else 0 * loaded_weight)
            return
        if self.tp_size > 1 and shard_id is None:
            # The weight [output, input]: keep this rank's input columns.
            loaded_weight = loaded_weight.narrow(1, self.input_start, param.shape[1])
        default_weight_loader(param, loaded_weight, shard_id)


__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "LinearMethodBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "QuantizationConfig",
    "ReplicatedLinear",
    "RowParallelLinear",
    "UnquantizedLinearMethod",
    "batch_invariant_enabled",
    "check_unsharded_method",
    "default_weight_loader",
    "set_weight_attrs",
]
