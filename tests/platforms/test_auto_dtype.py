"""``dtype="auto"`` keeps a half-precision checkpoint's dtype and runs a float32 one in the
platform's preferred dtype, as vLLM does (``Platform.auto_dtype``), logging what it picked.

Only ``config.json`` is read (an empty safetensors file makes the folder a checkpoint)."""

from __future__ import annotations

import json
import logging

import pytest

from kiln.config import KilnConfig
from kiln.platforms.cpu import CpuPlatform
from kiln.platforms.interface import Platform


class Float32Only(Platform):
    name = "f32only"
    supported_dtypes = ("float32",)


class Float32First(Platform):
    name = "f32first"
    supported_dtypes = ("float32", "bfloat16", "float16")


class Bfloat16First(Platform):
    name = "bf16first"
    supported_dtypes = ("bfloat16", "float32", "float16")


def _folder(tmp_path, torch_dtype: str | None) -> str:
    config = {"architectures": ["LlamaForCausalLM"]}
    if torch_dtype is not None:
        config["torch_dtype"] = torch_dtype
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return str(tmp_path)


@pytest.mark.parametrize("saved", ["bfloat16", "float16"])
def test_half_checkpoint_keeps_its_dtype(tmp_path, saved):
    config = KilnConfig().replace(model__model=_folder(tmp_path, saved))
    assert Float32First.auto_dtype(config) == saved  # not the preferred float32
    assert CpuPlatform.auto_dtype(config) == saved
    assert CpuPlatform.check_and_update_config(config).model.dtype == saved


@pytest.mark.parametrize(
    ("platform", "saved", "expected", "why"),
    [
        # A float32 checkpoint is halved, as vLLM does; --dtype float32 keeps it.
        (Bfloat16First, "float32", "bfloat16", "--dtype float32 keeps it"),
        # A dtype the platform lacks falls back to its preferred one.
        (Float32Only, "bfloat16", "float32", "runs only ['float32']"),
    ],
)
def test_auto_dtype_says_what_it_picked_and_why(tmp_path, caplog, platform, saved, expected, why):
    config = KilnConfig().replace(model__model=_folder(tmp_path, saved))
    with caplog.at_level(logging.INFO, logger="kiln.platforms.interface"):
        assert platform.auto_dtype(config) == expected
    assert f"the checkpoint is {saved}; running {expected}" in caplog.text
    assert why in caplog.text


def test_explicit_dtype_is_left_alone(tmp_path):
    config = KilnConfig().replace(
        model__model=_folder(tmp_path, "bfloat16"), model__dtype="float32"
    )
    assert CpuPlatform.check_and_update_config(config).model.dtype == "float32"


def test_no_checkpoint_dtype_takes_the_preferred(tmp_path):
    config = KilnConfig().replace(model__model=_folder(tmp_path, None))
    assert CpuPlatform.auto_dtype(config) == CpuPlatform.preferred_dtype(config)
    hub_id = KilnConfig().replace(model__model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert CpuPlatform.auto_dtype(hub_id) == CpuPlatform.preferred_dtype(hub_id)
