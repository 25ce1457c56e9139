"""Llama-family models on Kiln's paged KV cache (Llama 2/3, TinyLlama, SmolLM2, Mistral).

Contract, shared by every model in this package:
- ``Model(hf_config, dtype, prefix="", quant_config=None)``: ``hf_config`` is a dict of
  ``config.json`` keys (or an object with those attributes); parameters are created empty, in
  ``dtype``, on the current default device (build under ``with torch.device(...)``).
- ``forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]``: ``T`` is the flattened
  batch of every token scheduled this step, requests back to back. Attention layers read the
  step's metadata from the forward context and their KV caches from ``layer.kv_cache``.
- ``compute_logits(hidden_states [N, hidden]) -> [N, vocab]`` float32, for the rows the caller
  selected.
- ``load_weights(iterable of (hf_name, tensor)) -> set[str]``: Hugging Face names are mapped onto
  Kiln's fused parameters (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``);
  returns the names of the parameters that were completely loaded.
- ``attention_layers() -> dict[layer name, Attention]`` for binding KV caches.

Models know nothing about scheduling, sampling, devices or the weight file format. Variants
(Qwen2, Qwen3, Granite, OLMo 2, Phi-3, Gemma 2 and 3) reuse these blocks: they change
``DecoderArgs`` (biases, sliding windows, scales, soft caps) through ``parse_config`` /
``sliding_windows``, the attention class through ``attention_cls``, the block through
``decoder_layer_cls``, its feed-forward module through ``mlp_cls`` or the block's ``make_mlp``
(the MoE models: ``kiln.model_executor.models.moe``) and the final norm through ``norm_cls``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, ClassVar

import torch
from torch import nn

from kiln.distributed.parallel_state import get_pp_group
from kiln.model_executor.layers.activation import SiluAndMul
from kiln.model_executor.layers.attention import Attention, get_attention_layers
from kiln.model_executor.layers.layernorm import RMSNorm
from kiln.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantizationConfig,
    RowParallelLinear,
    default_weight_loader,
)
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding
from kiln.model_executor.layers.vocab_embedding import (
    LogitsProcessor,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from kiln.model_executor.models.pipeline import MissingLayer, is_on_other_stage


def config_dict(hf_config: Any) -> dict[str, Any]:
    """``hf_config`` as a plain dict: a dict, a ``PretrainedConfig`` or a simple namespace."""
    if isinstance(hf_config, dict):
        return hf_config
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(vars(hf_config))


def rope_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling or None)`` from old-style (``rope_theta`` + ``rope_scaling``)
    or transformers-5-style (``rope_parameters``) config keys."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
    scaling = cfg.get("rope_scaling")
    if not scaling and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    return theta, scaling or None


def join_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class DecoderArgs:
    """What the building blocks need from a config, normalized across architectures."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: the attention window, or None for full attention."""
    attention_scale: float | None = None
    """Multiplier of ``q @ k^T``; None: ``head_dim ** -0.5``."""
    embedding_multiplier: float = 1.0
    """Multiplier of the token embeddings before the first layer."""
    residual_multiplier: float = 1.0
    """Multiplier of each sub-layer's output before it joins the residual stream."""
    logits_scale: float = 1.0
    """Multiplier of the logits."""
    attn_logit_softcap: float | None = None
    """Attention scores ``s`` become ``cap * tanh(s / cap)`` (Gemma 2's); None: no cap."""
    local_rope_theta: float | None = None
    """Rotary base of the sliding-window layers, without scaling (Gemma 3's); None: theirs is
    ``rope_theta`` with ``rope_scaling``, as every layer's."""


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(
        self,
        args: DecoderArgs,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size,
            [size, size],
            bias=args.mlp_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=join_prefix(prefix, "gate_up_proj"),
        )
        self.down_proj = RowParallelLinear(
            size,
            args.hidden_size,
            bias=args.mlp_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=join_prefix(prefix, "down_proj"),
        )
        self.act_fn: nn.Module = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * inter] -> [T, inter] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary embedding, paged attention, output projection.

    Subclasses change how q and k are prepared for attention by overriding ``embed_positions``.
    """

    def __init__(
        self,
        args: DecoderArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size,
            args.head_dim,
            args.num_heads,
            args.num_kv_heads,
            bias=args.qkv_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=join_prefix(prefix, "qkv_proj"),
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim,
            args.hidden_size,
            bias=args.o_proj_bias,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=join_prefix(prefix, "o_proj"),
            input_shard=(self.qkv_proj.q_head_start * args.head_dim, self.q_size),
        )
        # One instance shared by every layer (its cos/sin cache is the same).
        self.rotary_emb = rotary_emb
        scale = args.head_dim**-0.5 if args.attention_scale is None else args.attention_scale
        self.attn = Attention(
            self.num_heads,
            args.head_dim,
            scale,
            self.num_kv_heads,
            prefix=join_prefix(prefix, "attn"),
            sliding_window=args.sliding_windows[layer_idx],
            logits_soft_cap=args.attn_logit_softcap,
        )

    def embed_positions(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H * D], k [T, Hkv * D] -> the same, ready for attention (rotated)."""
        return self.rotary_emb(positions, q, k)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 * Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.embed_positions(positions, q, k)
        out = self.attn(q, k, v)  # [T, H * D]
        return self.o_proj(out)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried beside the hidden states (fused adds).
    Each sub-layer's output is scaled by ``residual_multiplier`` (Granite's; 1 elsewhere).
    Subclasses change the MLP through ``mlp_cls`` and the norms through ``add_norms``."""

    mlp_cls: ClassVar[type[LlamaMLP]] = LlamaMLP

    def __init__(
        self,
        args: DecoderArgs,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(
            args, layer_idx, rotary_emb, dtype, quant_config, join_prefix(prefix, "self_attn")
        )
        self.mlp = self.make_mlp(args, layer_idx, dtype, quant_config, join_prefix(prefix, "mlp"))
        self.add_norms(args, dtype)
        self.residual_multiplier = args.residual_multiplier

    def add_norms(self, args: DecoderArgs, dtype: torch.dtype) -> None:
        """The block's norms: Llama's before the attention and before the MLP."""
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def norm_input(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_layernorm(x), x)`` of the block's input ``x = hidden_states + residual``."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def make_mlp(
        self,
        args: DecoderArgs,
        layer_idx: int,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> nn.Module:
        """The block's feed-forward module, ``[T, hidden] -> [T, hidden]``: ``mlp_cls`` (MoE
        models override it: a sparse block on some layers)."""
        return self.mlp_cls(args, dtype, quant_config, prefix)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual)``; their sum is the layer's output."""
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if self.residual_multiplier != 1.0:
            hidden_states = hidden_states * self.residual_multiplier
        return hidden_states, residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; in a pipeline, only this stage's part of them (the
    others are ``MissingLayer``s) and the hand-over of hidden states between stages."""

    def __init__(
        self,
        args: DecoderArgs,
        attention_cls: type[LlamaAttention],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer,
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.pp_group = get_pp_group()
        self.start_layer, self.end_layer = self.pp_group.layer_range(args.num_layers)
        self.hidden_size, self.dtype = args.hidden_size, dtype
        self.embedding_multiplier = args.embedding_multiplier
        self.embed_tokens = (
            VocabParallelEmbedding(
                args.vocab_size,
                args.hidden_size,
                dtype,
                prefix=join_prefix(prefix, "embed_tokens"),
                quant_config=quant_config,
            )
            if self.pp_group.is_first
            else MissingLayer()
        )
        rotary_emb = RotaryEmbedding(
            args.head_dim, args.max_position, args.rope_theta, args.rope_scaling, dtype
        )
        local_rotary_emb = rotary_emb
        if args.local_rope_theta is not None:
            local_rotary_emb = RotaryEmbedding(
                args.head_dim, args.max_position, args.local_rope_theta, None, dtype
            )
        self.layers = nn.ModuleList(
            decoder_layer_cls(
                args,
                i,
                rotary_emb if args.sliding_windows[i] is None else local_rotary_emb,
                attention_cls,
                dtype,
                quant_config,
                join_prefix(prefix, f"layers.{i}"),
            )
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(args.num_layers)
        )
        self.norm = (
            norm_cls(args.hidden_size, args.rms_norm_eps, dtype)
            if self.pp_group.is_last
            else MissingLayer()
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]: the final hidden states on the last stage; on the others,
        their last layer's output (it and the residual go to the next stage)."""
        if self.pp_group.is_first:
            hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
            residual = None
        else:
            # [2, T, hidden]: the previous stage's hidden states and residual
            received = torch.empty(
                (2, input_ids.shape[0], self.hidden_size), dtype=self.dtype, device=input_ids.device
            )
            hidden_states, residual = self.pp_group.recv_from_prev(received)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.pp_group.is_last:
            assert residual is not None  # every stage holds a layer (layer_range); it sets one
            self.pp_group.send_to_next(torch.stack([hidden_states, residual]))
            return hidden_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama-architecture causal LM; see the module docstring for the contract."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # Built with (args, layer_idx, rotary_emb, attention_cls, dtype, quant_config, prefix);
    # forward(positions, hidden_states, residual) -> (hidden_states, residual), as Llama's.
    decoder_layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # the final norm
    # Checkpoint module name -> (Kiln's fused module, shard id).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.args = self.parse_config(hf_config)
        self.dtype = dtype
        self.model = LlamaModel(
            self.args,
            self.attention_cls,
            dtype,
            quant_config,
            join_prefix(prefix, "model"),
            self.decoder_layer_cls,
            self.norm_cls,
        )
        pp_group = self.model.pp_group
        self.lm_head = (
            ParallelLMHead(
                self.args.vocab_size,
                self.args.hidden_size,
                params_dtype=dtype,
                prefix=join_prefix(prefix, "lm_head"),
                quant_config=quant_config,
            )
            if pp_group.is_last
            else MissingLayer()
        )
        # A last stage without the embedding loads the tied head from the embedding's tensor.
        self.loads_head_from_embedding = self.args.tie_word_embeddings and not pp_group.is_first
        if self.args.tie_word_embeddings and pp_group.world_size == 1:
            # One stage holds both, so neither is a MissingLayer.
            embed_tokens = self.model.embed_tokens
            assert isinstance(self.lm_head, ParallelLMHead)
            assert isinstance(embed_tokens, VocabParallelEmbedding)
            self.lm_head.tie_weights(embed_tokens)
        self.logits_processor = LogitsProcessor(self.args.vocab_size, self.args.logits_scale)

    @classmethod
    def parse_config(cls, hf_config: Any) -> DecoderArgs:
        """Normalize a Hugging Face config.

        Raises:
            ValueError: an activation other than SiLU, or unsupported rope scaling.
        """
        cfg = config_dict(hf_config)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; allowed: 'silu'")
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        theta, scaling = rope_config(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        return DecoderArgs(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=cls.sliding_windows(cfg, num_layers),
        )

    @staticmethod
    def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        """Per-layer attention windows: ``sliding_window`` (Mistral) on every layer, or on the
        layers ``layer_types`` marks ``sliding_attention`` when the config has them."""
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if window is None:
            return (None,) * num_layers
        if layer_types:
            return tuple(window if t == "sliding_attention" else None for t in layer_types)
        return (int(window),) * num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [T], ``positions`` [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.logits_processor(self.lm_head, hidden_states)

    def attention_layers(self) -> dict[str, Attention]:
        """Attention layers by name, in layer order, for binding KV caches."""
        return get_attention_layers(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors into this model's (fused) parameters.

        Skips rotary ``inv_freq`` buffers, with tied embeddings ``lm_head.*``, and the tensors of
        other pipeline stages.

        Returns:
            names (as in ``named_parameters()``) of the parameters fully loaded; a fused
            parameter counts once all its shards were seen.

        Raises:
            ValueError: a tensor has no matching parameter, or its shape does not fit.
        """
        params = dict(self.named_parameters())
        all_shards: dict[str, set[str | int]] = {}
        for fused_name, shard_id in self.packed_modules.values():
            all_shards.setdefault(fused_name, set()).add(shard_id)
        seen_shards: dict[str, set[str | int]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if self.args.tie_word_embeddings and hf_name.startswith("lm_head."):
                continue
            if self.loads_head_from_embedding and hf_name == "model.embed_tokens.weight":
                hf_name = "lm_head.weight"
            name, packed = self._param_name(hf_name)
            param = params.get(name)
            if param is None and is_on_other_stage(self, name):
                continue
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of "
                    f"{type(self).__name__} (looked for {name!r})"
                )
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if packed is None:
                weight_loader(param, tensor)
                loaded.add(name)
            else:
                fused, shard = packed
                weight_loader(param, tensor, shard)
                seen = seen_shards.setdefault(name, set())
                seen.add(shard)
                if seen == all_shards[fused]:
                    loaded.add(name)
        return loaded

    def _param_name(self, hf_name: str) -> tuple[str, tuple[str, str | int] | None]:
        """``(parameter name, (fused module, shard id) or None)`` of a checkpoint name."""
        parts = hf_name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                fused, shard = self.packed_modules[part]
                parts[i] = fused
                return ".".join(parts), (fused, shard)
        return hf_name, None


__all__ = [
    "DecoderArgs",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "config_dict",
    "rope_config",
]
