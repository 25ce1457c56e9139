"""Load a model from a local Hugging Face folder: ``config.json`` plus ``*.safetensors``.

Contract: the folder is used as it is on disk. ``load_hf_config`` is ``config.json`` parsed;
``iter_weights`` yields every tensor of every shard under its checkpoint name, floating-point ones
cast to the requested dtype. A tied checkpoint without ``lm_head.weight`` is passed through as is:
tying is the model's business. The tokenizer is read from the same folder.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from kiln.model_executor.loader.base import ModelLoader

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The weight files of ``folder``, in load order.

    With an index (sharded checkpoint) exactly the shards it names; otherwise ``model*.safetensors``
    if any (some repos also ship a ``consolidated.safetensors`` copy in another layout), else every
    ``*.safetensors``.

    Raises:
        FileNotFoundError: no weight file, or the index names a missing shard.
    """
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {folder!r} names missing shards: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "model*.safetensors")))
    files = files or sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    return files


class SafetensorsLoader(ModelLoader):
    """Loads a local folder holding ``config.json`` and safetensors weights."""

    name = "safetensors"

    @classmethod
    def can_load(cls, model: str) -> bool:
        return (
            os.path.isdir(model)
            and os.path.isfile(os.path.join(model, CONFIG_FILE))
            and bool(glob.glob(os.path.join(model, "*.safetensors")))
        )

    def load_hf_config(self, model: str) -> dict[str, Any]:
        """``config.json`` of the folder.

        Raises:
            FileNotFoundError: the folder has no ``config.json``.
        """
        path = os.path.join(model, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model!r} has no {CONFIG_FILE}")
        with open(path) as f:
            config: dict[str, Any] = json.load(f)
        return config

    def iter_weights(self, model: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every tensor of every shard, one at a time.

        Integer and boolean tensors (rare buffers) keep their dtype.
        """
        from safetensors import safe_open

        for path in safetensors_files(model):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    def tokenizer_source(self, model: str) -> str:
        return model


__all__ = ["SafetensorsLoader", "safetensors_files"]
