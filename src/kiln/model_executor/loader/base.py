"""The model-loader interface: where a model's config and weights come from.

A loader turns a model reference (a path, a hub id) into a Hugging Face-style config dict (the keys
of ``config.json``) and a stream of ``(name, tensor)`` pairs named as in Hugging Face checkpoints
(``model.layers.0.self_attn.q_proj.weight``). Model classes consume only that; they never know
which file format the weights came from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch


class ModelLoader(ABC):
    """Base of every loader; registered by name in ``LOADER_REGISTRY``."""

    name: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def can_load(cls, model: str) -> bool:
        """Whether this loader understands ``model`` (cheap: reads the path, not the weights)."""

    @abstractmethod
    def load_hf_config(self, model: str) -> dict[str, Any]:
        """The model's config as a ``config.json``-style dict (architectures, sizes, rope)."""

    @abstractmethod
    def iter_weights(self, model: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every weight, dequantized to ``dtype``, under its Hugging Face name."""

    @abstractmethod
    def tokenizer_source(self, model: str) -> str:
        """The path ``kiln.tokenizer.load_tokenizer`` reads the tokenizer and chat template from."""
