"""HubLoader against a fake, offline Hugging Face cache (the hub is unreachable in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file

from kiln.model_executor.loader import get_loader
from kiln.model_executor.loader.hub import HubLoader

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF cache holding ``kiln-test/tiny`` (config + one safetensors file), offline mode on."""
    cache = tmp_path / "hub"
    repo = cache / "models--kiln-test--tiny"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    save_file({"model.norm.weight": torch.arange(4.0)}, str(snapshot / "model.safetensors"))
    # Without tensors: a repo that exists in the cache but has no safetensors weights.
    other = cache / "models--kiln-test--ggufonly"
    (other / "snapshots" / REVISION).mkdir(parents=True)
    (other / "refs").mkdir()
    (other / "refs" / "main").write_text(REVISION)
    (other / "snapshots" / REVISION / "config.json").write_text("{}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads these once at import; the env vars above cover fresh processes.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return snapshot


def test_loads_from_offline_cache(hub_cache: Path) -> None:
    loader = get_loader("kiln-test/tiny")
    assert isinstance(loader, HubLoader)
    assert loader.load_hf_config("kiln-test/tiny") == {"architectures": ["Qwen3ForCausalLM"]}
    weights = dict(loader.iter_weights("kiln-test/tiny", torch.bfloat16))
    assert list(weights) == ["model.norm.weight"]
    assert torch.equal(weights["model.norm.weight"], torch.arange(4.0, dtype=torch.bfloat16))
    assert Path(loader.tokenizer_source("kiln-test/tiny")).resolve() == hub_cache.resolve()


def test_missing_repo_or_weights_is_an_os_error(hub_cache: Path) -> None:
    with pytest.raises(OSError, match="kiln-test/absent"):
        HubLoader().load_hf_config("kiln-test/absent")
    with pytest.raises(OSError, match="no config.json and \\*.safetensors"):
        HubLoader().load_hf_config("kiln-test/ggufonly")


def test_can_load_only_repo_ids_that_are_not_paths(tmp_path: Path, monkeypatch) -> None:
    assert HubLoader.can_load("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not HubLoader.can_load("just-a-name")
    assert not HubLoader.can_load("/abs/path")
    assert not HubLoader.can_load("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not HubLoader.can_load("org/name")  # an existing local folder wins
