"""SafetensorsLoader on tiny local folders: single file, sharded with an index, tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.model_executor.loader import get_loader
from kiln.model_executor.loader.safetensors_loader import SafetensorsLoader, safetensors_files

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "tie_word_embeddings": True}


def tiny_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(6, 8, generator=gen, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=gen),
        "model.norm.weight": torch.randn(8, generator=gen),
        "model.rotary.step": torch.tensor([3], dtype=torch.int64),  # a non-float buffer
    }


def write_folder(folder: Path, weights: dict[str, torch.Tensor], shards: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"))
        return
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[i::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("shards", [1, 2])
def test_loads_every_tensor_cast_to_dtype(tmp_path: Path, shards: int) -> None:
    weights = tiny_weights()
    write_folder(tmp_path / "m", weights, shards=shards)
    model = str(tmp_path / "m")
    assert SafetensorsLoader.can_load(model)
    assert isinstance(get_loader(model), SafetensorsLoader)

    loader = SafetensorsLoader()
    assert loader.load_hf_config(model) == CONFIG
    assert loader.tokenizer_source(model) == model
    loaded = dict(loader.iter_weights(model, torch.float32))
    assert set(loaded) == set(weights)  # tied: no lm_head.weight, and that is fine
    for name, expected in weights.items():
        want_dtype = torch.float32 if expected.is_floating_point() else expected.dtype
        assert loaded[name].dtype == want_dtype, name
        assert torch.equal(loaded[name], expected.to(want_dtype)), name
    assert len(safetensors_files(model)) == shards


def test_index_names_only_its_shards(tmp_path: Path) -> None:
    write_folder(tmp_path, tiny_weights(), shards=2)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    names = {name for name, _ in SafetensorsLoader().iter_weights(str(tmp_path), torch.float16)}
    assert "stray" not in names and len(names) == 4
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing shards"):
        safetensors_files(str(tmp_path))


def test_can_load_needs_config_and_weights(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert not SafetensorsLoader.can_load(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text("{}")
    assert SafetensorsLoader.can_load(str(tmp_path))
    assert not SafetensorsLoader.can_load(str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        SafetensorsLoader().load_hf_config(str(tmp_path / "nowhere"))
