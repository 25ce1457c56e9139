"""PEFT LoRA adapter folders: reading them and checking them against the model.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and ``adapter_model.safetensors`` with, per adapted projection,
``base_model.model.<module>.lora_A.weight`` [r, in_features] and ``...lora_B.weight``
[out_features, r]. The projection adds ``scaling * B @ A @ x`` to the base output, ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

Kiln adapts the Llama family's seven projections (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``); their shapes follow from the model's
``config.json`` (``projection_shapes``), so the front end checks an adapter completely, from its
config and the tensors' shapes, before any request runs with it. Anything else an adapter asks
for (another module, a rank above ``lora.max_lora_rank``, DoRA, per-module ranks, trained biases
or extra modules) is a ``ValueError`` naming the adapter and what is allowed.

This module knows nothing about Kiln's fused layers or the runner's slots (``model_manager``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""What PEFT puts before the base model's module names."""
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, in Hugging Face names."""


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says that Kiln uses."""

    rank: int
    scaling: float
    """Multiplies ``B @ A``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    target_modules: tuple[str, ...]


@dataclass
class LoRAAdapter:
    """An adapter's weights, by Hugging Face module name (``model.layers.0.self_attn.q_proj``):
    ``(A [r, in], B [out, r])`` with ``scaling`` not yet applied."""

    name: str
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{projection: (in_features, out_features)}`` of a Llama-family model's layers."""
    hidden = int(hf_config["hidden_size"])
    num_heads = int(hf_config["num_attention_heads"])
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    head_dim = int(hf_config.get("head_dim") or hidden // num_heads)
    inter = int(hf_config["intermediate_size"])
    return {
        "q_proj": (hidden, num_heads * head_dim),
        "k_proj": (hidden, num_kv_heads * head_dim),
        "v_proj": (hidden, num_kv_heads * head_dim),
        "o_proj": (num_heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(path: str, name: str, max_rank: int) -> AdapterConfig:
    """Read and check ``path``'s ``adapter_config.json``.

    Raises:
        ValueError: no such folder or file, a config that is no JSON, or a setting Kiln does
            not serve (see module doc). No message holds the path.
    """
    config_path = os.path.join(path, CONFIG_FILE)
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        # NOTE: no path in the message: requests that name the adapter get it too.
        raise ValueError(
            f"LoRA adapter {name!r}: lora_path is not a PEFT adapter folder (no {missing[0]}); "
            f"allowed: a folder with {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise _unreadable(name, CONFIG_FILE, exc) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"LoRA adapter {name!r}: {CONFIG_FILE} holds a JSON {type(raw).__name__}; allowed: "
            "an object, as peft's save_pretrained writes it"
        )
    peft_type = raw.get("peft_type", "LORA")
    unsupported = {
        "peft_type": peft_type != "LORA",
        "use_dora": bool(raw.get("use_dora")),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
        "bias": raw.get("bias", "none") != "none",
        "modules_to_save": bool(raw.get("modules_to_save")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
    }
    for key, refused in unsupported.items():
        if refused:
            raise ValueError(
                f"LoRA adapter {name!r}: {key}={raw.get(key)!r} is not supported; allowed: a "
                "plain LoRA (peft_type LORA, no DoRA, bias 'none', no modules_to_save, one rank "
                "and alpha for every module)"
            )
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank r={rank!r} is invalid; allowed: 1..{max_rank} "
            "(lora.max_lora_rank, --max-lora-rank)"
        )
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(
            f"LoRA adapter {name!r}: target_modules={targets!r} (a regular expression) is not "
            f"supported; allowed: a list of module names from {list(LORA_MODULES)}"
        )
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"LoRA adapter {name!r}: target_modules={targets!r} is invalid; allowed: a list of "
            f"module names from {list(LORA_MODULES)}"
        )
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        raise ValueError(
            f"LoRA adapter {name!r}: target module(s) {unknown} are not in the model; allowed: "
            f"{list(LORA_MODULES)}"
        )
    alpha = raw.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(
            f"LoRA adapter {name!r}: lora_alpha={alpha!r} is invalid; allowed: a finite number"
        )
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scaling, tuple(targets))


def _module_name(tensor_name: str) -> tuple[str, str]:
    """``(module, "lora_A" | "lora_B")`` of a PEFT tensor name, or ``("", "")``."""
    name = tensor_name.removeprefix(PREFIX)
    for part in ("lora_A", "lora_B"):
        for suffix in (f".{part}.weight", f".{part}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], part
    return "", ""


def check_adapter(path: str, name: str, hf_config: dict[str, Any], max_rank: int) -> AdapterConfig:
    """Check the adapter at ``path`` against the model (config and tensor shapes; the tensors
    are not read).

    Raises:
        ValueError: see ``read_adapter_config``; or a tensor for a module the model lacks (a
            layer past ``num_hidden_layers``, a projection not in ``LORA_MODULES``), of the wrong
            shape, or without its partner (A without B).
    """
    from safetensors import safe_open

    config = read_adapter_config(path, name, max_rank)
    shapes = projection_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    found: dict[str, set[str]] = {}
    try:
        weights = safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt")
    except Exception as exc:  # OSError, or safetensors' own error for a bad header
        raise _unreadable(name, WEIGHTS_FILE, exc) from None
    with weights as f:
        for tensor_name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            module, part = _module_name(tensor_name)
            projection = module.rsplit(".", 1)[-1]
            layer = module.split(".")[2] if module.startswith("model.layers.") else ""
            if (
                not part
                or projection not in shapes
                or not layer.isdigit()
                or int(layer) >= num_layers
                or module != f"model.layers.{layer}.{_parent(projection)}.{projection}"
            ):
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {tensor_name!r} targets a module the model "
                    f"lacks; allowed: model.layers.<0..{num_layers - 1}>.(self_attn|mlp).<one of "
                    f"{list(LORA_MODULES)}>.lora_A/lora_B"
                )
            in_features, out_features = shapes[projection]
            expected = (
                (config.rank, in_features) if part == "lora_A" else (out_features, config.rank)
            )
            shape = tuple(f.get_slice(tensor_name).get_shape())
            if shape != expected:
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {tensor_name!r} has shape {list(shape)}; "
                    f"allowed: {list(expected)} (rank {config.rank}, the model's {projection})"
                )
            found.setdefault(module, set()).add(part)
    for module, parts in found.items():
        if parts != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has {sorted(parts)} only")
    return config


def _unreadable(name: str, file: str, exc: Exception) -> ValueError:
    """The error for an adapter file that cannot be read: the reason's kind, not its text (which
    may hold the path)."""
    return ValueError(
        f"LoRA adapter {name!r}: {file} cannot be read ({type(exc).__name__}); allowed: a PEFT "
        "adapter folder as peft's save_pretrained writes it"
    )


def _parent(projection: str) -> str:
    return "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def load_adapter(path: str, name: str, hf_config: dict[str, Any], max_rank: int) -> LoRAAdapter:
    """Check the adapter (``check_adapter``) and read its weights (float32, on CPU).

    Raises:
        ValueError: see ``check_adapter``; or the weights cannot be read (the file changed
            since the check).
    """
    from safetensors.torch import load_file

    config = check_adapter(path, name, hf_config, max_rank)
    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except Exception as exc:  # changed since the check: gone, truncated, rewritten
        raise _unreadable(name, WEIGHTS_FILE, exc) from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        module, part = _module_name(tensor_name)
        parts.setdefault(module, {})[part] = tensor.float()
    weights = {module: (p["lora_A"], p["lora_B"]) for module, p in parts.items()}
    return LoRAAdapter(name, config, weights)


def files_signature(path: str) -> tuple[int, ...] | None:
    """``(mtime_ns, size)`` of the adapter's two files, or None when one is missing: it changes
    when a file is removed or rewritten (a training job saving a new checkpoint)."""
    signature: tuple[int, ...] = ()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = os.stat(os.path.join(path, file))
        except OSError:
            return None
        signature += (stat.st_mtime_ns, stat.st_size)
    return signature


class AdapterChecker:
    """The front end's check of a ``LoRARequest`` before it reaches the engine, cached per
    ``(lora_int_id, lora_path)`` while its files' ``files_signature`` stays the same (two
    ``stat`` calls per request; the files are read again only when they changed).

    Args:
        max_rank: ``lora.max_lora_rank``.
        hf_config: the model's ``config.json``.
    """

    def __init__(self, max_rank: int, hf_config: dict[str, Any]) -> None:
        self.max_rank = max_rank
        self.hf_config = hf_config
        self._checked: dict[tuple[int, str], tuple[int, ...]] = {}
        """The files' signature when each adapter last passed the check."""

    def __call__(self, lora_request: Any) -> None:
        """Raises ``ValueError`` for an adapter the engine cannot serve (see ``check_adapter``),
        its files gone or changed into one included."""
        key = (lora_request.lora_int_id, lora_request.lora_path)
        signature = files_signature(lora_request.lora_path)
        if signature is None or self._checked.get(key) != signature:
            self._checked.pop(key, None)
            check_adapter(
                lora_request.lora_path, lora_request.lora_name, self.hf_config, self.max_rank
            )
            if signature is not None:
                self._checked[key] = signature


__all__ = [
    "LORA_MODULES",
    "AdapterChecker",
    "AdapterConfig",
    "LoRAAdapter",
    "check_adapter",
    "files_signature",
    "load_adapter",
    "projection_shapes",
    "read_adapter_config",
]
