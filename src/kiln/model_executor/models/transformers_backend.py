"""Any causal LM transformers implements: its own modeling code, on Kiln's paged attention.

Contract (the model contract of ``kiln.model_executor.models.llama``, for an architecture Kiln has
no class for; ``--model-impl transformers`` or ``auto``):

- ``TransformersForCausalLM(hf_config, dtype, prefix="", quant_config=None)`` builds transformers'
  class for ``hf_config``'s architecture with ``attn_implementation="kiln"``, whose attention
  function (``kiln_attention``, registered in transformers' ``AttentionInterface``) hands each
  layer's query, key and value to a Kiln ``Attention`` (the platform's backend, the paged KV
  cache). Every ``nn.Linear`` but the output embeddings becomes a Kiln ``ReplicatedLinear`` of
  the same name, so the platform's linear method runs it (``--quantization int8|int4`` applies);
  embeddings, rotary embeddings, norms and activations are transformers' code, given Kiln's
  positions. Kiln learns each layer's head counts, head size, scale, sliding window and soft cap
  by running the model once on one token at construction, from what transformers passes its
  attention function; a layer whose attention Kiln cannot run (attention sinks, a non-causal
  layer) is a ``ValueError`` then, and a call whose arguments differ from what was recorded is a
  ``RuntimeError``, never a silently different result.
- ``forward(input_ids [T], positions [T])``: the step's tokens as one sequence of batch 1 with
  ``position_ids`` = Kiln's positions and no transformers cache; transformers builds no attention
  mask for ``"kiln"`` (no mask function is registered for it), each request's causal extent comes
  from the step's attention metadata.
- ``compute_logits``: the causal LM's own head code (its final soft cap or logit scale) on the
  rows the caller selected, in float32.
- ``load_weights``: checkpoint names are renamed as transformers renames them on load (its
  checkpoint conversion mapping for the architecture: ``embed_out`` -> ``lm_head``...); a tensor
  that transformers would convert (split, fuse, transpose: its ``WeightConverter`` rules, e.g.
  MoE experts fused into one tensor) or that matches no parameter is a ``ValueError``.
- ``engine_config``: ``hf_config`` with the standard keys the engine sizes with
  (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``hidden_size``, ``vocab_size``, ``max_position_embeddings``) filled from the model itself,
  whatever its config calls them.

Tensor parallelism shards the linear layers by transformers' ``base_model_tp_plan``
(``_adopt_linears``); each rank's attention takes its share of the heads.

Not supported (each a ``ValueError`` at construction): LoRA, pipeline parallelism, tensor
parallelism without a plan or with KV heads it does not divide, and architectures whose
attention is not causal self-attention.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.model_executor.layers.attention import Attention, get_attention_layers
from kiln.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kiln.model_executor.models.llama import config_dict

ATTN_IMPLEMENTATION = "kiln"
KILN_ATTENTION = "kiln_attn"
"""The name of the ``Attention`` child Kiln adds to each transformers attention module."""
UNSUPPORTED_KWARGS = ("s_aux", "sinks")
"""Attention-function arguments that change the result in ways Kiln's attention does not
implement (GPT-OSS's attention sinks)."""


@dataclass(frozen=True)
class LayerCall:
    """What transformers passed one layer's attention function in the recording run."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    soft_cap: float | None


_recording: list[tuple[nn.Module, LayerCall]] | None = None


def _layer_call(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> LayerCall:
    """The shape and options of one attention call (``query [1, H, T, D]``, ``key [1, Hkv, T,
    D]``); the scale defaults to ``D ** -0.5`` as transformers' SDPA attention does."""
    head_size = query.shape[-1]
    scale = kwargs.get("scaling")
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    return LayerCall(
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        head_size=head_size,
        scale=float(head_size**-0.5 if scale is None else scale),
        sliding_window=int(window) if window else None,
        soft_cap=float(cap) if cap else None,
    )


def kiln_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [1, H, T, D]``, ``key`` and ``value``
    ``[1, Hkv, T, D]`` -> ``([1, T, H, D], None)``. ``attention_mask`` is None (none is built
    for ``"kiln"``) and unused: the step's attention metadata bounds each request."""
    unsupported = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if unsupported or kwargs.get("is_causal") is False:
        what = f"argument(s) {unsupported}" if unsupported else "is_causal=False"
        raise ValueError(
            f"{type(module).__name__} passes its attention {what}, which Kiln's attention does "
            "not implement; allowed: causal self-attention without sinks"
        )
    call = _layer_call(query, key, kwargs)
    num_tokens = query.shape[2]
    if _recording is not None:
        _recording.append((module, call))
        return query.new_zeros(1, num_tokens, call.num_heads, call.head_size), None
    attn: Attention = getattr(module, KILN_ATTENTION)
    recorded = LayerCall(
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_size,
        attn.scale,
        attn.sliding_window,
        attn.logits_soft_cap,
    )
    if call != recorded:
        raise RuntimeError(
            f"{attn.layer_name}: transformers passed {call}; recorded at construction: {recorded}"
        )

    def tokens_first(x: torch.Tensor) -> torch.Tensor:  # [1, heads, T, D] -> [T, heads * D]
        return x[0].transpose(0, 1).reshape(num_tokens, -1)

    out = attn(tokens_first(query), tokens_first(key), tokens_first(value))
    return out.view(1, num_tokens, call.num_heads, call.head_size), None


def register_attention() -> None:
    """Register ``kiln_attention`` as transformers' ``"kiln"`` attention (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kiln_attention)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[nn.Module, LayerCall]]]:
    """Within the block, ``kiln_attention`` records each call's module and shape (and returns
    zeros) instead of attending."""
    global _recording
    calls: list[tuple[nn.Module, LayerCall]] = []
    previous, _recording = _recording, calls
    try:
        yield calls
    finally:
        _recording = previous


class _Passthrough(nn.Module):
    """Stands in for the base model in the head-only copy: returns the hidden states it is given
    as ``inputs_embeds``."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=inputs_embeds)


def _plan_pattern(key: str) -> str:
    """A ``base_model_tp_plan`` key (``layers.*.self_attn.q_proj``) as a regular expression."""
    return r"[^.]+".join(re.escape(part) for part in key.split("*"))


class _TokensFirst(nn.Module):
    """Takes transformers' ``[batch, tokens, features]`` inputs into a Kiln linear layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])


class _Linear(_TokensFirst, ReplicatedLinear):
    pass


class _ColumnLinear(_TokensFirst, ColumnParallelLinear):
    pass


class _RowLinear(_TokensFirst, RowParallelLinear):
    pass


class TransformersForCausalLM(nn.Module):
    """A causal LM from transformers' modeling code on Kiln's attention; see the module doc."""

    _head: Any
    """The causal LM with a passthrough base model: its forward is the head code alone."""
    _causal_lm: Any
    """transformers' model itself (its modules are this module's children)."""

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        prefix: str = "",
        quant_config: Any = None,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        from kiln.config import get_current_config

        config = get_current_config()
        if config is not None and config.lora.enable_lora:
            raise ValueError(
                "lora.enable_lora=True is not supported with model_impl='transformers' (Kiln's "
                "adapter slots wrap Kiln's linear layers); allowed: False"
            )
        if config is not None and config.parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"parallel.pipeline_parallel_size={config.parallel.pipeline_parallel_size} is "
                "not supported with model_impl='transformers'; allowed: 1"
            )
        self.tp_size = 1 if config is None else config.parallel.tensor_parallel_size
        register_attention()
        cfg = dict(config_dict(hf_config))
        model_type = cfg.pop("model_type")
        hf = AutoConfig.for_model(model_type, **cfg)
        causal_lm = AutoModelForCausalLM.from_config(
            hf, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
        causal_lm.requires_grad_(False)  # inference only (a graph tracer refuses grad constants)
        self.dtype = dtype
        text = hf.get_text_config()
        self.vocab_size = int(text.vocab_size)
        # The causal LM's children become this module's, so parameter names are checkpoint
        # names (``model.layers.0.self_attn.q_proj.weight``).
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        self._base_name = causal_lm.base_model_prefix
        # A copy of the causal LM whose base model passes hidden states through: its forward is
        # transformers' head code alone. Kept out of the module tree (its modules are ours).
        head = copy.copy(causal_lm)
        head._modules = dict(causal_lm._modules)
        head._modules[self._base_name] = _Passthrough()
        self.__dict__["_head"] = head
        self.__dict__["_causal_lm"] = causal_lm  # for its checkpoint conversion rules
        self._add_attention_layers()
        # After the recording run: a platform's linear method may pack its weights at a first
        # call, and the recording ran on transformers' initial weights.
        tp_plan = getattr(text, "base_model_tp_plan", None) or {}
        if self.tp_size > 1 and not tp_plan:
            raise ValueError(
                f"{type(causal_lm).__name__} has no base_model_tp_plan; tensor parallelism with "
                "model_impl='transformers' needs one; allowed: tensor_parallel_size=1"
            )
        self._adopt_linears(causal_lm.get_output_embeddings(), tp_plan, dtype, quant_config)
        layers = list(self.attention_layers().values())
        self.engine_config = {
            **config_dict(hf_config),
            "num_hidden_layers": len(layers),
            "num_attention_heads": layers[0].num_heads,
            "num_key_value_heads": layers[0].num_kv_heads,
            "head_dim": layers[0].head_size,
            "hidden_size": int(text.hidden_size),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 2048),
        }

    def _adopt_linears(
        self, head: Any, tp_plan: dict[str, str], dtype: torch.dtype, quant_config: Any
    ) -> None:
        """Every ``nn.Linear`` but the output embeddings becomes a Kiln linear layer of the same
        name and shape: the platform's linear method runs it (its fused or traced kernels,
        ``--quantization int8|int4``). With tensor parallelism, the base model's
        ``base_model_tp_plan`` (transformers' own, as vLLM's transformers backend reads it)
        shards it: ``colwise`` -> ``ColumnParallelLinear``, ``rowwise`` -> ``RowParallelLinear``
        (an all-reduce of the partial sums), the others are replicated. The head and the
        embeddings stay transformers' and whole on every rank, whatever the plan says (the
        head's weight may be tied to the input embeddings).

        Raises:
            ValueError: with tensor parallelism, a plan entry of another style, or one that names
                a module that is neither ``nn.Linear`` nor ``nn.Embedding`` (GPT-2's ``Conv1D``).
        """
        plan = [(re.compile(_plan_pattern(k)), style) for k, style in tp_plan.items()]
        base = f"{self._base_name}."
        for parent_name, parent in list(self.named_modules()):
            for name, child in list(parent.named_children()):
                prefix = f"{parent_name}.{name}" if parent_name else name
                local = prefix.removeprefix(base)
                style = next((st for pattern, st in plan if pattern.fullmatch(local)), None)
                # An embedding the plan shards is kept whole (the same rows, gathered).
                sharded = style is not None and not isinstance(child, nn.Embedding)
                if self.tp_size > 1 and sharded and type(child) is not nn.Linear:
                    raise ValueError(
                        f"{prefix} is a {type(child).__name__}; tensor parallelism with "
                        "model_impl='transformers' shards nn.Linear layers only; allowed: "
                        "tensor_parallel_size=1"
                    )
                if type(child) is not nn.Linear or child is head:
                    continue
                size_in, size_out, bias = child.in_features, child.out_features, child.bias
                linear: nn.Module
                if self.tp_size == 1 or style is None:
                    linear = _Linear(
                        size_in, size_out, bias is not None, dtype, quant_config, prefix
                    )
                elif style == "colwise":
                    linear = _ColumnLinear(
                        size_in, [size_out], bias is not None, dtype, quant_config, prefix
                    )
                elif style == "rowwise":
                    linear = _RowLinear(
                        size_in, size_out, bias is not None, dtype, quant_config, prefix
                    )
                else:
                    raise ValueError(
                        f"{prefix}: base_model_tp_plan style {style!r} is not supported with "
                        "model_impl='transformers'; allowed: 'colwise', 'rowwise'"
                    )
                setattr(parent, name, linear)

    def _add_attention_layers(self) -> None:
        """Runs the model once on one token, recording each attention call, and gives every
        attention module a Kiln ``Attention`` of the recorded shape.

        Raises:
            ValueError: no attention call, layers of different KV shapes (one KV-cache layout
                serves them all), or an attention Kiln does not implement.
        """
        names = {id(m): name for name, m in self.named_modules()}
        with recording() as calls, torch.no_grad():
            self.forward(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        if not calls:
            raise ValueError(
                f"{type(self).__name__}: the model made no attention call through "
                f"attn_implementation={ATTN_IMPLEMENTATION!r}; its attention is not supported"
            )
        shapes = {(call.num_kv_heads, call.head_size) for _, call in calls}
        if len(shapes) > 1:
            raise ValueError(
                f"layers of different (KV heads, head size) {sorted(shapes)} are not supported "
                "with model_impl='transformers'"
            )
        if any(call.num_kv_heads % self.tp_size for _, call in calls):
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} must divide every layer's KV heads "
                f"({sorted(shapes)}) with model_impl='transformers'"
            )
        for module, call in calls:
            if hasattr(module, KILN_ATTENTION):
                raise ValueError(
                    f"{names[id(module)]} is called twice per forward; shared attention layers "
                    "are not supported with model_impl='transformers'"
                )
            name = f"{names[id(module)]}.{KILN_ATTENTION}"
            module.add_module(
                KILN_ATTENTION,
                Attention(
                    call.num_heads // self.tp_size,  # the recording ran on every head
                    call.head_size,
                    call.scale,
                    call.num_kv_heads // self.tp_size,
                    prefix=name,
                    sliding_window=call.sliding_window,
                    logits_soft_cap=call.soft_cap,
                ),
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [T], ``positions`` [T] -> hidden states [T, hidden]."""
        base = getattr(self, self._base_name)
        out = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, through the causal LM's own head code."""
        logits = self._head(inputs_embeds=hidden_states[None], logits_to_keep=0).logits[0]
        return logits[:, : self.vocab_size].float()

    def attention_layers(self) -> dict[str, Attention]:
        return get_attention_layers(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters and persistent buffers of the same name.

        Returns:
            the names (as ``named_parameters()`` gives them) of the parameters loaded; a tied
            parameter counts under either of its names.

        Raises:
            ValueError: a tensor whose name is no parameter or buffer, or whose shape differs.
        """
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        params = dict(self.named_parameters(remove_duplicate=False))
        buffers = dict(self.named_buffers())
        canonical = {id(p): name for name, p in self.named_parameters()}
        transforms = get_model_conversion_mapping(self._causal_lm)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        loaded: set[str] = set()
        with torch.no_grad():
            for checkpoint_name, tensor in weights:
                name, converted = rename_source_key(checkpoint_name, renamings, converters)
                if converted is not None:
                    raise ValueError(
                        f"checkpoint tensor {checkpoint_name!r} needs transformers' weight "
                        f"conversion {converted!r}, which model_impl='transformers' does not run"
                    )
                target: torch.Tensor | None = params.get(name)
                if target is None:
                    target = buffers.get(name)
                    if target is None and name.endswith("rotary_emb.inv_freq"):
                        continue  # recomputed by the model
                if target is None:
                    raise ValueError(
                        f"checkpoint tensor {checkpoint_name!r} matches no parameter of "
                        f"{type(self._causal_lm).__name__} (looked for {name!r})"
                    )
                loader = getattr(target, "weight_loader", None)
                if loader is not None:  # a Kiln linear layer's parameter (its method's layout)
                    loader(target, tensor)
                    loaded.add(canonical[id(target)])
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {checkpoint_name!r} has shape {tuple(tensor.shape)}; "
                        f"{name!r} has "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(tensor)
                if name in params:
                    loaded.add(canonical[id(params[name])])
        return loaded


__all__ = [
    "ATTN_IMPLEMENTATION",
    "TransformersForCausalLM",
    "kiln_attention",
    "register_attention",
]
