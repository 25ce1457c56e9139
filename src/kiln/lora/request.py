"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A msgspec struct, so it crosses the front end -> engine core socket inside ``EngineCoreRequest``
and reaches the model runner inside ``NewRequestData``. ``lora_int_id`` names the adapter
everywhere past the front end: the runner's slots, the prefix cache's block hashes, the
scheduler's count of adapters in a batch; two adapters must never share an id. This module knows
nothing about weights or models.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An adapter: a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        ValueError: ``lora_int_id`` below 1 or an empty ``lora_name`` / ``lora_path``.
    """

    lora_name: str
    """What clients send as ``model``."""
    lora_int_id: int
    """The adapter's identity in the engine, >= 1 (0 and below would be the base model)."""
    lora_path: str
    """The PEFT adapter folder."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid; allowed: an int >= 1")
        if not self.lora_name:
            raise ValueError("lora_name is empty; allowed: a non-empty name")
        if not self.lora_path:
            raise ValueError("lora_path is empty; allowed: a PEFT adapter folder")


__all__ = ["LoRARequest"]
