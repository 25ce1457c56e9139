"""load_model's checks (every parameter loaded, no stray tensors) and KV-cache sizing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln.model_executor.model_loader import kv_cache_bytes_per_token, load_model
from kiln.testing.models import save_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    save_tiny_model(folder, "qwen2", vocab_size=64, hidden_size=32, intermediate_size=48)
    return folder


def _rewrite(folder, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_loads_every_parameter_in_dtype(tiny_folder) -> None:
    model, config = load_model(str(tiny_folder), torch.bfloat16)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.bfloat16)
    qkv = model.model.layers[1].self_attn.qkv_proj
    attn = hf.model.layers[1].self_attn
    expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    torch.testing.assert_close(qkv.bias, expected, rtol=0, atol=0)


def test_missing_tensor_is_named(tiny_folder, tmp_path) -> None:
    folder = tmp_path / "missing"
    folder.mkdir()
    for f in tiny_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _rewrite(
        folder, lambda t: (t.pop("model.layers.1.self_attn.k_proj.weight"), t.pop("lm_head.weight"))
    )
    with pytest.raises(ValueError, match="left 2 parameters") as info:
        load_model(str(folder), torch.float32)
    # A fused parameter missing one shard counts as unloaded.
    assert "model.layers.1.self_attn.qkv_proj.weight" in str(info.value)
    assert "lm_head.weight" in str(info.value)


def test_stray_tensor_is_refused(tiny_folder, tmp_path) -> None:
    folder = tmp_path / "stray"
    folder.mkdir()
    for f in tiny_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _rewrite(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="extra_proj"):
        load_model(str(folder), torch.float32)


def test_kv_cache_bytes_per_token() -> None:
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 1024,
        "head_dim": 128,
    }  # Qwen3-0.6B
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 28 * 2 * 8 * 128 * 2
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}  # MHA
    assert kv_cache_bytes_per_token(config, torch.float32) == 2 * 2 * 4 * 16 * 4
