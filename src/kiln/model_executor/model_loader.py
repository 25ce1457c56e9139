"""Build a model from a model reference: pick a loader, build the architecture, load its weights.

Contract: ``load_model(model_ref, dtype, device)`` returns a ready-to-run model (every parameter
loaded, in eval mode, on ``device``) and the Hugging Face-style config dict it was built from. It
joins three registries (loaders, architectures, and the model's own weight mapping) and checks
their result: a parameter that no checkpoint tensor filled is an error, never silently
uninitialized memory.

``kv_cache_bytes_per_token(config, dtype)`` is what the engine sizes its KV cache with.

This module knows nothing about scheduling or KV-cache allocation.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from kiln.model_executor.layers.linear import LinearBase
from kiln.model_executor.loader import get_loader
from kiln.model_executor.models.llama import config_dict
from kiln.model_executor.registry import resolve_model_cls

logger = logging.getLogger(__name__)


def load_model(
    model_ref: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    quant_config: Any = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Load ``model_ref`` (a GGUF file, a Hugging Face folder, a hub id).

    Args:
        model_ref: what the user passed as the model.
        dtype: compute dtype of the parameters.
        device: where the parameters live.
        load_format: a registered loader name, or ``"auto"`` to pick by ``model_ref``.
        quant_config: a ``QuantizationConfig`` for the linear layers, or None (dense).

    Returns:
        ``(model, hf_config)``.

    Raises:
        ValueError: no loader accepts ``model_ref``, its architecture is not registered, a
            checkpoint tensor fits no parameter, or parameters were left unloaded (listed).
    """
    start = time.perf_counter()
    loader = get_loader(model_ref, load_format)
    hf_config = loader.load_hf_config(model_ref)
    model_cls = resolve_model_cls(hf_config.get("architectures") or [])
    # Only Kiln's own models are known to take quant_config; a plugin's may not.
    kwargs = {} if quant_config is None else {"quant_config": quant_config}
    with torch.device(device):
        model = model_cls(hf_config, dtype=dtype, **kwargs)
    loaded = model.load_weights(loader.iter_weights(model_ref, dtype))
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
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    model.eval()
    logger.info(
        "loaded %s (%s, %s) in %.2f s",
        model_ref,
        model_cls.__name__,
        dtype,
        time.perf_counter() - start,
    )
    return model, hf_config


def kv_cache_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the KV cache, all layers, keys and values:
    ``num_layers * 2 * num_kv_heads * head_dim * dtype size``."""
    cfg = config_dict(hf_config)
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads)
    return int(cfg["num_hidden_layers"]) * 2 * num_kv_heads * head_dim * dtype.itemsize


__all__ = ["kv_cache_bytes_per_token", "load_model"]
