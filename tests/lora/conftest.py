"""LoRA test fixtures: a tiny random Llama and PEFT adapters made with ``peft`` on it.

Each adapter has random, non-trivial A and B weights on the seven projections (PEFT initializes
B to zero, which would make any adapter a no-op), is saved as a PEFT folder, and is also merged
into a copy of the base model with PEFT's ``merge_and_unload`` (the reference: Kiln with the
adapter must match Kiln on the merged weights). Package-scoped: the offline and the server tests
share them.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest
import torch

from kiln.lora.peft import LORA_MODULES
from kiln.testing.models import save_tiny_model


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    """The PEFT folder."""
    merged: str
    """The base model with the adapter merged into its weights (a Hugging Face folder)."""
    rank: int


def make_adapter(
    base: str,
    folder: pathlib.Path,
    name: str,
    *,
    seed: int,
    rank: int,
    use_rslora: bool = False,
    target_modules: tuple[str, ...] = LORA_MODULES,
) -> Adapter:
    """A PEFT LoRA of ``base`` with random weights, saved with its merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        use_rslora=use_rslora,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    path, merged = folder / name, folder / f"{name}-merged"
    peft_model.save_pretrained(path)
    peft_model.merge_and_unload().save_pretrained(merged)
    return Adapter(name, str(path), str(merged), rank)


@pytest.fixture(scope="package")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (256-token vocabulary, peaked logits so greedy ties are unlikely)."""
    folder = tmp_path_factory.mktemp("lora") / "base"
    return save_tiny_model(folder, initializer_range=0.2, seed=0)


@pytest.fixture(scope="package")
def adapters(tiny_base: str, tmp_path_factory: pytest.TempPathFactory) -> list[Adapter]:
    """Three adapters: ranks 8, 4 (rsLoRA scaling) and 8 (attention projections only)."""
    folder = tmp_path_factory.mktemp("adapters")
    return [
        make_adapter(tiny_base, folder, "a0", seed=1, rank=8),
        make_adapter(tiny_base, folder, "a1", seed=2, rank=4, use_rslora=True),
        make_adapter(
            tiny_base,
            folder,
            "a2",
            seed=3,
            rank=8,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    ]
