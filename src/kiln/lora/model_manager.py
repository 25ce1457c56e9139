"""The model runner's side of LoRA: linear layers with adapter slots, and which adapter sits in
which slot.

``LoRAModelManager(model, ...)`` replaces each of the model's adaptable linear layers (Kiln's
fused ``qkv_proj`` and ``gate_up_proj``, and ``o_proj``, ``down_proj``) by a ``LoRALinear``
around it: the base layer's output plus the ``lora_apply`` op over ``max_loras`` slots of stacked
A and B weights, ``max_lora_rank`` wide (a fused layer's slices share one shrink and one expand:
its slices' A rows are stacked, its B is block-diagonal). Each step the runner calls
``set_active_loras`` with the step's requests; the manager loads the adapters the step needs into
slots (evicting the least recently used adapter no request of the step needs) and builds the
step's ``LoRAMapping`` (every token's slot, ``-1`` for a base-model token), which every layer
shares. A step without adapters adds nothing and costs nothing.

An adapter that fails to load (its folder was removed or rewritten since the front end checked
it) fails the step's requests that name it, and only those: ``set_active_loras`` returns them
with the reason, they run this step on the base model (the scheduler discards their tokens and
finishes them with an error), and the slot keeps what it held. Nothing else in the step changes.

Contract with the scheduler: a step names at most ``max_loras`` distinct adapters (the scheduler
holds back requests for another one). Tensor parallelism is refused (``ValueError``): the slots
are not sharded yet. Graphs: the runner runs the model eagerly when LoRA is on (a step's slots
are an input no captured graph knows about).

This module knows nothing about scheduling or HTTP; adapters come from their folders
(``kiln.lora.peft``), which the front end checked already.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.config import LoRAConfig
from kiln.lora.peft import LORA_MODULES, LoRAAdapter, load_adapter
from kiln.lora.request import LoRARequest
from kiln.model_executor.layers.linear import LinearBase
from kiln.model_executor.layers.lora import LoRAApply, LoRAMapping

logger = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """What every ``LoRALinear`` reads in a forward, set once per step by the manager."""

    mapping: LoRAMapping | None = None
    """Each token's slot; None: no adapter this step."""


class LoRALinear(nn.Module):
    """``base(x)`` plus each token's adapter (``lora_apply``).

    Args:
        base: the linear layer (any quantization method; tensor-parallel size 1).
        projections: the Hugging Face projections of its output slices, in order
            (``["q_proj", "k_proj", "v_proj"]`` for ``qkv_proj``).
        num_slots: ``max_loras``.
        max_rank: ``max_lora_rank``.
        dtype: the model's compute dtype.
        device: where the slots live.
        step: the manager's per-step state, shared by every layer.
    """

    # Buffers (register_buffer), declared for the type checker.
    lora_a: torch.Tensor
    """[num_slots, len(projections) * max_rank, in]: each slice's A rows, stacked."""
    lora_b: torch.Tensor
    """[num_slots, len(projections) * max_rank, out]: B transposed, block-diagonal."""

    def __init__(
        self,
        base: LinearBase,
        projections: list[str],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoRAStep,
    ) -> None:
        super().__init__()
        self.base = base
        self.projections = projections
        self.output_slices = tuple(base.output_partition_sizes)
        assert len(self.output_slices) == len(projections), (base.prefix, projections)
        self.max_rank = max_rank
        width = len(projections) * max_rank
        # The op's layout: A rows of every slice stacked, B transposed and block-diagonal.
        shape_a, shape_b = (num_slots, width, base.input_size), (num_slots, width, base.output_size)
        self.register_buffer("lora_a", torch.zeros(shape_a, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(shape_b, dtype=dtype, device=device))
        self.step = step
        self.lora_apply = LoRAApply()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        mapping = self.step.mapping
        if mapping is None:
            return y
        return self.lora_apply(y, x, self.lora_a, self.lora_b, mapping, self.output_slices)

    def set_slot(
        self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float
    ) -> None:
        """Put one adapter's ``(A [r, in], B [out_i, r])`` per slice (None: the slice is not
        adapted) into ``slot``, ``B`` scaled; the rest of the slot is zeroed."""
        self.lora_a[slot] = 0
        self.lora_b[slot] = 0
        offset = 0
        for i, (size, pair) in enumerate(zip(self.output_slices, weights, strict=True)):
            if pair is not None:
                a, b = pair
                rows = slice(i * self.max_rank, i * self.max_rank + a.shape[0])
                self.lora_a[slot, rows] = a
                self.lora_b[slot, rows, offset : offset + size] = (b * scaling).T
            offset += size


class LoRAModelManager:
    """Adapter slots over a loaded model (see the module docstring).

    Args:
        model: a Llama-family Kiln model (``packed_modules`` maps checkpoint projections onto
            its fused layers); its layers are replaced in place.
        config: ``lora.*``.
        hf_config: the model's ``config.json`` (adapters are checked against it).
        dtype: the model's compute dtype.
        device: where the slots live.

    Raises:
        ValueError: a layer is tensor-parallel.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.hf_config = hf_config
        self.device = device
        self.step = LoRAStep()
        self.layers: dict[str, LoRALinear] = {}
        """Wrapped layers by their Kiln module name (``model.layers.0.self_attn.qkv_proj``)."""
        fused: dict[str, list[str]] = {}
        for projection, (module, _shard) in getattr(model, "packed_modules", {}).items():
            fused.setdefault(module, []).append(projection)
        for name, module in list(model.named_modules()):
            parent_name, _, leaf = name.rpartition(".")
            projections = fused.get(leaf, [leaf])
            if not isinstance(module, LinearBase) or not set(projections) <= set(LORA_MODULES):
                continue
            if getattr(module, "tp_size", 1) > 1:
                raise ValueError(
                    "lora.enable_lora with parallel.tensor_parallel_size > 1 is not supported "
                    "yet; allowed: tensor_parallel_size 1"
                )
            wrapper = LoRALinear(
                module, projections, self.max_loras, self.max_rank, dtype, device, self.step
            )
            setattr(model.get_submodule(parent_name), leaf, wrapper)
            self.layers[name] = wrapper
        self.slot_lora_ids: list[int | None] = [None] * self.max_loras
        """The adapter id in each slot (None: empty)."""
        self._slot_last_used = [0] * self.max_loras
        self._num_steps = 0
        self._requests: dict[str, LoRARequest] = {}

    def add_request(self, req_id: str, lora_request: LoRARequest | None) -> None:
        """Note which adapter ``req_id`` runs with (None: the base model)."""
        if lora_request is not None:
            self._requests[req_id] = lora_request

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def set_active_loras(self, req_ids: list[str], num_scheduled: np.ndarray) -> dict[str, str]:
        """Prepare the step: ``req_ids`` in the batch's order, ``num_scheduled`` [num_reqs] their
        tokens (back to back, as the model sees them).

        Returns:
            ``{req_id: why}`` for the requests whose adapter failed to load (see the module
            docstring); empty when every adapter is in its slot.

        Side effects: loads adapters into slots (reading their folders); sets
        ``step.mapping``; logs each adapter that failed to load, with its folder.

        Raises:
            RuntimeError: the step names more than ``max_loras`` adapters (a scheduler bug).
        """
        loras = [self._requests.get(req_id) for req_id in req_ids]
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not needed:
            self.step.mapping = None
            return {}
        if len(needed) > self.max_loras:
            raise RuntimeError(
                f"a step names {len(needed)} LoRA adapters, more than max_loras={self.max_loras}"
            )
        self._num_steps += 1
        slot_of = {}
        errors: dict[int, str] = {}
        for lora_id, lora in needed.items():
            if lora_id not in self.slot_lora_ids:
                error = self._load(lora, self._free_slot(needed))
                if error is not None:
                    errors[lora_id] = error
                    continue
            slot = self.slot_lora_ids.index(lora_id)
            slot_of[lora_id] = slot
            self._slot_last_used[slot] = self._num_steps
        per_req = np.array(
            [-1 if lora is None else slot_of.get(lora.lora_int_id, -1) for lora in loras],
            dtype=np.int64,
        )
        # Every adapter of the step failed: the step is the base model's.
        has_adapter = bool(slot_of)
        self.step.mapping = (
            LoRAMapping(np.repeat(per_req, num_scheduled), self.device) if has_adapter else None
        )
        return {
            req_id: errors[lora.lora_int_id]
            for req_id, lora in zip(req_ids, loras, strict=True)
            if lora is not None and lora.lora_int_id in errors
        }

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        """An empty slot, else the least recently used one whose adapter the step does not
        need."""
        if None in self.slot_lora_ids:
            return self.slot_lora_ids.index(None)
        candidates = [s for s, i in enumerate(self.slot_lora_ids) if i not in needed]
        return min(candidates, key=lambda s: self._slot_last_used[s])

    def _load(self, lora: LoRARequest, slot: int) -> str | None:
        """Load ``lora`` into ``slot``; returns why it failed (no path in it), else None."""
        try:
            adapter: LoRAAdapter = load_adapter(
                lora.lora_path, lora.lora_name, self.hf_config, self.max_rank
            )
        except Exception as exc:  # the adapter's files: gone, truncated, rewritten
            logger.error(
                "LoRA adapter %r (%s) failed to load", lora.lora_name, lora.lora_path, exc_info=exc
            )
            if isinstance(exc, ValueError):  # peft's own checks: messages without paths
                return str(exc)
            return f"LoRA adapter {lora.lora_name!r} failed to load ({type(exc).__name__})"
        self.slot_lora_ids[slot] = None  # until every layer holds the new adapter
        with torch.no_grad():
            for name, layer in self.layers.items():
                prefix = name.rpartition(".")[0]
                weights = [adapter.weights.get(f"{prefix}.{p}") for p in layer.projections]
                layer.set_slot(slot, weights, adapter.config.scaling)
        self.slot_lora_ids[slot] = lora.lora_int_id
        return None


__all__ = ["LoRALinear", "LoRAModelManager", "LoRAStep"]
