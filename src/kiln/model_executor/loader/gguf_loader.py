"""Load a model from one GGUF file (llama.cpp's format): config from metadata, weights dequantized.

Contract: ``GGUFLoader`` presents a GGUF file exactly as if it were the Hugging Face checkpoint it
was converted from. ``load_hf_config`` returns ``config.json`` keys; ``iter_weights`` yields
HF-named tensors of torch shape ``[out_features, in_features]`` (GGUF lists dims innermost first,
so its ``[in, out]`` is our ``[out, in]``), dequantized to float32 and cast to the requested dtype.
The Q/K projections of llama-arch files are un-permuted back to the HF rotary layout (see
``_unpermute_qk``). Architectures: llama, qwen2, qwen3, gemma2, gemma3 (whose norm weights
llama.cpp stores as ``1 + w``: the loader subtracts the 1).

With ``keep_quantized=True`` (the model loader passes it when the platform keeps GGUF blocks,
``model.quantization`` "gguf"), every quantized 2-D tensor is yielded as a ``GGUFWeight`` (raw
block bytes, rows in ``[out, in]`` order, Q/K rows un-permuted: rows are whole blocks) instead;
float tensors (norms) are yielded as before.

``open_gguf`` parses a file's header once per process and file version (``gguf_file.GGUFFile``,
a tenth of ``gguf.GGUFReader``'s time on SmolLM2's vocabulary). The tensor data stay
memory-mapped until dequantized one at a time.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kiln.model_executor.layers.quantization import GGUFWeight
from kiln.model_executor.loader.base import ModelLoader
from kiln.model_executor.loader.dequant import dequantize
from kiln.model_executor.loader.gguf_file import GGUF_MAGIC, GGUFFile

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (HF architectures entry, HF model_type).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


def gguf_architectures() -> dict[str, str]:
    """GGUF ``general.architecture`` -> the Hugging Face architecture it loads as."""
    return {arch: hf_arch for arch, (hf_arch, _) in _ARCHITECTURES.items()}


# llama.cpp's converter interleaves the Q/K rows of these architectures for its rope kernel.
_ROPE_PERMUTED_ARCHS = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's blocks norm before and after each sub-layer; its ffn_norm is the pre-MLP norm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHS = frozenset({"gemma2", "gemma3"})
# GGUF holds no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models (these
# layer counts), head_dim for the others.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)

# Tensors llama.cpp adds that are no Hugging Face parameter (rope_freqs: precomputed llama3 rope
# factors; the config's rope_scaling carries the same information).
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})

# Llama 3.x rope_scaling values other than the factor; every released Llama 3.1-3.3 uses them.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``) in architecture ``arch``, or None if it has
    none."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match:
        layer, kind, param = match.groups()
        names = _GEMMA_LAYER_NAMES if arch in _GEMMA_ARCHS else _LAYER_NAMES
        if kind not in names:
            return None
        return f"model.layers.{layer}.{names[kind]}.{param}"
    base, _, param = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and param in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{param}"
    return None


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    HF's rotary embedding pairs dimension ``i`` with ``i + head_dim/2`` of each head; llama.cpp's
    converter reorders every head's rows so the pairs sit next to each other (``(2, d/2) ->
    (d/2, 2)``). This is the inverse: per head, rows ``(d/2, 2) -> (2, d/2)``. Works for weights
    ``[num_heads * head_dim, in]`` and biases ``[num_heads * head_dim]``.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    assert head_dim * num_heads == rows and head_dim % 2 == 0, (weight.shape, num_heads)
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _is_gguf_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GGUFLoader(ModelLoader):
    """Loads llama/qwen2/qwen3 models from a ``.gguf`` file."""

    name = "gguf"

    @classmethod
    def can_load(cls, model: str) -> bool:
        return _is_gguf_file(model)

    def reader(self, model: str) -> GGUFFile:
        """The parsed header of ``model`` (``open_gguf``: parsed once per process).

        Raises:
            FileNotFoundError: ``model`` is not a file.
            ValueError: the file is not GGUF.
        """
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist or is not a file")
        if not _is_gguf_file(model):
            raise ValueError(f"{model!r} is not a GGUF file (no 'GGUF' magic)")
        return open_gguf(model)

    def load_hf_config(self, model: str) -> dict[str, Any]:
        """Map the GGUF metadata to ``config.json`` keys.

        Raises:
            ValueError: the file's architecture is not one of ``_ARCHITECTURES``, or required
                metadata is missing.
        """
        reader = self.reader(model)
        meta = _Metadata(reader, model)
        arch = meta.require("general.architecture")
        if arch not in _ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {arch!r} of {model!r} is not supported; supported: "
                f"{sorted(_ARCHITECTURES)}"
            )
        hf_arch, model_type = _ARCHITECTURES[arch]
        tensors = {t.name: t for t in reader.tensors}

        hidden_size = int(meta.require(f"{arch}.embedding_length"))
        num_heads = int(meta.require(f"{arch}.attention.head_count"))
        num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
        # token_embd is stored [hidden, vocab] (GGUF dim order); the tensor is the ground truth.
        vocab_size = int(tensors["token_embd.weight"].shape[-1])

        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden_size,
            "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(meta, arch, tensors, head_dim),
            "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
            "vocab_size": vocab_size,
            "tie_word_embeddings": "output.weight" not in tensors,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            # Quantized weights dequantize exactly only to float32; plain float files keep theirs.
            "torch_dtype": self._dtype_name(tensors),
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "hidden_act": "silu",
        }
        if arch in _GEMMA_ARCHS:
            config.update(self._gemma_config(meta, arch, config))
        return config

    @staticmethod
    def _gemma_config(meta: _Metadata, arch: str, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma's keys: its activation, soft caps and window from the metadata; what GGUF does
        not hold (the attention scalar, Gemma 3's local rotary base and layer pattern) as
        llama.cpp assumes it."""
        big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        per_head = config["hidden_size"] // config["num_attention_heads"]
        extra: dict[str, Any] = {
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": per_head if big else config["head_dim"],
            "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
            "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        }
        if arch == "gemma3":
            extra["rope_local_base_freq"] = 10000.0
            extra["sliding_window_pattern"] = int(
                meta.get(f"{arch}.attention.sliding_window_pattern", 6)
            )
        return extra

    @staticmethod
    def _dtype_name(tensors: dict[str, Any]) -> str:
        # The embedding matrix is the tensor a converter most reliably keeps at the file's type.
        kind = tensors["token_embd.weight"].tensor_type.name
        return {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")

    @staticmethod
    def _rope_scaling(
        meta: _Metadata, arch: str, tensors: dict[str, Any], head_dim: int
    ) -> dict[str, Any] | None:
        kind = meta.get(f"{arch}.rope.scaling.type")
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if kind in ("linear", "yarn") and factor:
            scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
            original = meta.get(f"{arch}.rope.scaling.original_context_length")
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        if "rope_freqs.weight" not in tensors:
            return None
        # Llama 3.x: llama.cpp stores the per-frequency divisors instead of the rope_scaling
        # parameters. Rebuild them from the released Llama 3 defaults and check they reproduce
        # the stored divisors, so a file with other parameters is not silently mis-roped.
        freqs = dequantize(
            tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
        )
        theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        scaling = {"rope_type": "llama3", "factor": float(freqs.max()), **_LLAMA3_ROPE_DEFAULTS}
        expected = llama3_rope_divisors(theta, head_dim, scaling)
        if expected.shape != freqs.shape or not np.allclose(expected, freqs, rtol=1e-3):
            raise ValueError(
                "GGUF rope_freqs do not match Llama 3 rope_scaling with "
                f"{_LLAMA3_ROPE_DEFAULTS}; this file's rope scaling is not supported"
            )
        return scaling

    def iter_weights(
        self, model: str, dtype: torch.dtype, keep_quantized: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, tensor)`` for every weight, one tensor dequantized at a time, or,
        with ``keep_quantized``, quantized 2-D tensors as ``GGUFWeight`` (a copy of the blocks).

        Side effects: opens (and caches) the file's reader. Tensors with no HF counterpart are
        skipped (``rope_freqs``) or skipped with a warning (anything unknown).
        """
        reader = self.reader(model)
        meta = _Metadata(reader, model)
        arch = meta.require("general.architecture")
        num_heads = int(meta.require(f"{arch}.attention.head_count"))
        num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
        unpermute_heads = (
            {"attn_q": num_heads, "attn_k": num_kv_heads} if arch in _ROPE_PERMUTED_ARCHS else {}
        )
        for tensor in reader.tensors:
            if tensor.name in _SKIPPED_TENSORS:
                continue
            hf_name = hf_tensor_name(tensor.name, arch)
            if hf_name is None:
                logger.warning("GGUF tensor %s has no Hugging Face name; skipped", tensor.name)
                continue
            kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            qtype = GGMLQuantizationType(tensor.tensor_type)
            if keep_quantized and qtype not in _FLOAT_TYPES and tensor.data.ndim == 2:
                blocks = tensor.data  # uint8 [rows, row_bytes]: GGUF rows are [out, in] rows
                if kind in unpermute_heads:
                    blocks = _unpermute_qk(blocks, unpermute_heads[kind])
                block_size, type_size = GGML_QUANT_SIZES[qtype]
                shape = (blocks.shape[0], blocks.shape[1] // type_size * block_size)
                yield hf_name, GGUFWeight(torch.from_numpy(np.array(blocks)), qtype, shape)
                continue
            # Logical shape in torch order (dims reversed from GGUF's), e.g. [out, in].
            weight = dequantize(tensor.data, tensor.tensor_type)
            if kind in unpermute_heads:
                weight = _unpermute_qk(weight, unpermute_heads[kind])
            if arch in _GEMMA_ARCHS and hf_name.endswith("norm.weight"):
                weight = weight - 1  # llama.cpp stores Gemma's norm scales, 1 + w
            yield hf_name, torch.from_numpy(np.ascontiguousarray(weight)).to(dtype)

    def tokenizer_source(self, model: str) -> str:
        return model


def llama3_rope_divisors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3 rope scaling (what llama.cpp stores as ``rope_freqs``):
    1 for short wavelengths, ``factor`` for long ones, a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, blended)
    return np.where(wavelen > original / low, factor, divisors).astype(np.float32)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of ``path``, shared by every caller in the process while the file is
    unchanged: the tokenizer, the config and the weights of one model each ask for it."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _open_gguf_cached(real, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class _Metadata:
    """Typed access to a reader's key/value metadata."""

    def __init__(self, reader: GGUFFile, path: str) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else self._value(field)

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"GGUF file {self._path!r} lacks required metadata key {key!r}")
        return self._value(self._fields[key])

    @staticmethod
    def _value(field: Any) -> Any:
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            # The shortest decimal that round-trips the float32 (1e-05, not 9.999999747e-06), as
            # the config.json the file was converted from said.
            value = float(str(np.float32(value)))
        return value


__all__ = ["GGUFLoader", "hf_tensor_name", "llama3_rope_divisors", "open_gguf"]
