"""Build a model from a model reference: pick a loader, build the architecture, load its weights.

Contract: ``load_model(model_ref, dtype, device)`` returns a ready-to-run model (every parameter
loaded, in eval mode, on ``device``) and the Hugging Face-style config dict it was built from. It
joins three registries (loaders, architectures, and the model's own weight mapping) and checks
their result: a parameter that no checkpoint tensor filled is an error, never silently
uninitialized memory.

Quantization: ``resolve_quant_config`` turns ``model.quantization`` into the ``QuantizationConfig``
of the platform the caller passes (``Platform.get_quant_config``; without one, Kiln's reference
methods) or None (dense weights); with "gguf" the GGUF loader yields raw blocks (``GGUFWeight``)
that the layers' methods keep. This module never selects a platform.

``kv_cache_bytes_per_token(config, dtype)`` is what the engine sizes its KV cache with.
``checkpoint_dtype(model)`` is a local checkpoint's own precision (what ``dtype="auto"`` keeps).

This module knows nothing about scheduling or KV-cache allocation.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch import nn

from kiln.model_executor.layers.linear import QuantizationConfig
from kiln.model_executor.loader import ModelLoader, get_loader, resolve_model_ref
from kiln.model_executor.loader.gguf_loader import GGUFLoader
from kiln.model_executor.models.llama import config_dict
from kiln.model_executor.registry import resolve_model_cls

logger = logging.getLogger(__name__)


def load_model(
    model_ref: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    quant_config: Any = None,
    quantization: str | None = None,
    platform: Any = None,
    model_impl: str = "auto",
) -> tuple[nn.Module, dict[str, Any]]:
    """Load ``model_ref`` (a GGUF file, a Hugging Face folder, a hub id).

    Args:
        model_ref: what the user passed as the model.
        dtype: compute dtype of the parameters.
        device: where the parameters live.
        load_format: a registered loader name, or ``"auto"`` to pick by ``model_ref``.
        quant_config: a ``QuantizationConfig`` for the layers; None: ``quantization`` decides.
        quantization: ``model.quantization`` (None, "auto", "gguf", "int8", "int4", "none"),
            resolved with ``platform`` (``resolve_quant_config``).
        platform: the process's ``Platform`` class (the model runner passes it); None outside
            an engine: dense weights for "auto", Kiln's reference methods otherwise.
        model_impl: ``model.model_impl`` (``kiln.model_executor.registry.model_impl_of``).

    Returns:
        ``(model, hf_config)``; ``hf_config`` is the model's ``engine_config`` where it has one
        (the transformers backend: the standard size keys filled in).

    Raises:
        ValueError: no loader accepts ``model_ref``, its architecture is not registered, a
            checkpoint tensor fits no parameter, or parameters were left unloaded (listed), or
            ``quantization`` does not apply to this model or platform.
    """
    start = time.perf_counter()
    loader = get_loader(model_ref, load_format)
    hf_config = loader.load_hf_config(model_ref)
    if quant_config is None:
        quant_config = resolve_quant_config(quantization, loader, model_ref, platform)
    keep_gguf = quant_config is not None and quant_config.name == "gguf"
    if keep_gguf and not isinstance(loader, GGUFLoader):
        raise ValueError(
            f"model.quantization='gguf' keeps a GGUF file's blocks; {model_ref!r} is read by "
            f"{type(loader).__name__}; allowed for it: auto, none, int8, int4"
        )
    model_cls = resolve_model_cls(hf_config.get("architectures") or [], model_impl)
    # Only Kiln's own models are known to take quant_config; a plugin's may not.
    kwargs = {} if quant_config is None else {"quant_config": quant_config}
    with torch.device(device):
        model = model_cls(hf_config, dtype=dtype, **kwargs)
    weights = (
        loader.iter_weights(model_ref, dtype, keep_quantized=True)
        if keep_gguf and isinstance(loader, GGUFLoader)  # the isinstance holds (checked above)
        else loader.iter_weights(model_ref, dtype)
    )
    loaded = model.load_weights(weights)
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise ValueError(
            f"{model_ref!r} ({type(loader).__name__}) left {len(missing)} parameters of "
            f"{model_cls.__name__} unloaded: {shown}"
        )
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        # A tied LM head shares the embedding's storage, processed with the embedding.
        if method is not None and not getattr(module, "_tied_to", ()):
            method.process_weights_after_loading(module)
    model.eval()
    hf_config = getattr(model, "engine_config", hf_config)
    logger.info(
        "loaded %s (%s, %s, quantization %s) in %.2f s",
        model_ref,
        model_cls.__name__,
        dtype,
        quant_config.name if quant_config is not None else "none",
        time.perf_counter() - start,
    )
    return model, hf_config


def is_quantized_gguf(loader: ModelLoader, model_ref: str) -> bool:
    """Whether ``model_ref`` is a GGUF file with quantized (non-float) 2-D tensors."""
    if not isinstance(loader, GGUFLoader):
        return False
    floats = {"F32", "F16", "BF16"}
    return any(
        t.tensor_type.name not in floats and len(t.shape) == 2
        for t in loader.reader(model_ref).tensors
    )


def resolve_quant_config(
    quantization: str | None, loader: ModelLoader, model_ref: str, platform: Any = None
) -> QuantizationConfig | None:
    """The ``QuantizationConfig`` for ``model.quantization`` on ``platform``, or None for dense
    weights.

    None / "auto": "gguf" for a quantized GGUF file where the platform supports it, else dense
    (always dense without a platform). Without a platform, an explicit method gets Kiln's
    reference ``QuantizationConfig`` (``reference_quant_config``).

    Raises:
        ValueError: "gguf" for a model that is no quantized GGUF file, "int8" / "int4" for one
            that is, or a method the platform does not support (from
            ``Platform.get_quant_config``).
        InterfaceError: the platform's config does not implement ``QuantizationConfig``.
    """
    from kiln.config import get_current_config
    from kiln.model_executor.layers.quantization import reference_quant_config
    from kiln.plugins.interfaces import check_implements

    method = quantization or "auto"
    quantized_gguf = is_quantized_gguf(loader, model_ref)
    if method == "auto":
        supported = platform is not None and "gguf" in platform.supported_quantization
        method = "gguf" if quantized_gguf and supported else "none"
    if method == "none":
        return None
    if method == "gguf" and not quantized_gguf:
        raise ValueError(
            f"model.quantization='gguf' needs a quantized GGUF file; {model_ref!r} is not one; "
            "allowed for it: auto, none, int8, int4"
        )
    if method in ("int8", "int4") and quantized_gguf:
        raise ValueError(
            f"model.quantization={method!r} quantizes a float model on load; {model_ref!r} is "
            "already a quantized GGUF file; allowed for it: auto, gguf, none"
        )
    if platform is None:
        return reference_quant_config(method)
    quant_config = platform.get_quant_config(method, get_current_config())
    check_implements(type(quant_config), QuantizationConfig)
    return quant_config


CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(model: str | None, load_format: str = "auto") -> str | None:
    """The precision a checkpoint was saved in, one of ``CHECKPOINT_DTYPES``: its config's
    ``torch_dtype`` (``dtype`` where newer transformers writes that; a float GGUF file's
    embedding type). None where it names none, for a quantized GGUF file (no float precision
    to keep), or where ``model`` is no local file or folder: a hub id is not downloaded just for
    this (its load fetches it later).

    Raises:
        ValueError: no loader reads ``model`` (as its load would).
    """
    model_ref = resolve_model_ref(model)
    if not os.path.exists(model_ref):
        return None
    loader = get_loader(model_ref, load_format)
    if is_quantized_gguf(loader, model_ref):
        return None
    hf_config = loader.load_hf_config(model_ref)
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return name if name in CHECKPOINT_DTYPES else None


def kv_cache_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the KV cache, all layers, keys and values:
    ``num_layers * 2 * num_kv_heads * head_dim * dtype size``."""
    cfg = config_dict(hf_config)
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads)
    return int(cfg["num_hidden_layers"]) * 2 * num_kv_heads * head_dim * dtype.itemsize


__all__ = ["is_quantized_gguf", "kv_cache_bytes_per_token", "load_model", "resolve_quant_config"]
