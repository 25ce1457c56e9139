"""``LoRAConfig``: multi-LoRA serving."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.checks import check


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: PEFT adapters chosen per request, several of them in one batch."""

    enable_lora: bool = False
    """Serve LoRA adapters: ``--lora-modules``, ``LoRARequest`` offline, a request's ``model``."""
    max_loras: int = 1
    """Most distinct adapters in one batch (the slots of stacked adapter weights); a request for
    another adapter waits until a slot's requests finish."""
    max_lora_rank: int = 16
    """Largest adapter rank served; an adapter of a higher rank is refused when loaded. Every
    slot is this wide, so it sets the cost of the LoRA matmuls."""

    def __post_init__(self) -> None:
        check(self.max_loras >= 1, "lora.max_loras", self.max_loras, "an integer >= 1")
        check(self.max_lora_rank >= 1, "lora.max_lora_rank", self.max_lora_rank, "an integer >= 1")
