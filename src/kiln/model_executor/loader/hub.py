"""Load a model by Hugging Face hub id (``org/name``): download, then load the local snapshot.

Contract: ``HubLoader`` fetches only what Kiln reads (config, tokenizer files, safetensors weights)
with ``huggingface_hub.snapshot_download`` into the standard HF cache (``HF_HOME`` /
``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` serves from the cache alone) and hands the snapshot folder to
``SafetensorsLoader``. It never downloads on ``can_load``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from kiln.model_executor.loader.base import ModelLoader
from kiln.model_executor.loader.safetensors_loader import SafetensorsLoader

# org/name, each part of the characters the hub allows.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")

ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]


class HubLoader(ModelLoader):
    """Loads ``org/name`` from the Hugging Face hub (or its local cache).

    Args:
        revision: branch, tag or commit to fetch; None for the default branch.
        cache_dir: HF cache folder; None for the library's default (``HF_HUB_CACHE``).
    """

    name = "hub"

    def __init__(self, revision: str | None = None, cache_dir: str | None = None) -> None:
        self.revision = revision
        self.cache_dir = cache_dir
        self._snapshots: dict[str, str] = {}  # repo id -> local snapshot folder
        self._local = SafetensorsLoader()

    @classmethod
    def can_load(cls, model: str) -> bool:
        return bool(_REPO_ID.fullmatch(model)) and not os.path.exists(model)

    def snapshot(self, model: str) -> str:
        """The local folder of ``model``'s snapshot, downloading it on first use.

        Raises:
            ValueError: ``model`` is not an ``org/name`` id.
            OSError: the snapshot can be neither downloaded nor found in the cache; or it has no
                ``config.json`` / safetensors weights (Kiln loads no other hub format).
        """
        if model in self._snapshots:
            return self._snapshots[model]
        if not _REPO_ID.fullmatch(model):
            raise ValueError(f"model={model!r} is not a Hugging Face hub id like 'org/name'")
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(
                model,
                revision=self.revision,
                cache_dir=self.cache_dir,
                allow_patterns=ALLOW_PATTERNS,
            )
        except Exception as exc:  # the hub raises many types: offline, 404, gated, disk...
            raise OSError(
                f"could not get {model!r} from the Hugging Face hub or its local cache "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if not SafetensorsLoader.can_load(folder):
            raise OSError(
                f"hub snapshot of {model!r} at {folder!r} has no config.json and *.safetensors; "
                "Kiln loads safetensors checkpoints from the hub (or a local .gguf file)"
            )
        self._snapshots[model] = folder
        return folder

    def load_hf_config(self, model: str) -> dict[str, Any]:
        return self._local.load_hf_config(self.snapshot(model))

    def iter_weights(self, model: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        return self._local.iter_weights(self.snapshot(model), dtype)

    def tokenizer_source(self, model: str) -> str:
        return self.snapshot(model)


__all__ = ["ALLOW_PATTERNS", "HubLoader"]
