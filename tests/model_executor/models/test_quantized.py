"""Weights kept quantized (``model.quantization``): Kiln's reference methods on real models.

- GGUF: the default model (SmolLM2-135M, Q4_1 linears, Q8_0 embedding tied as the LM head) loaded
  with ``GGUFQuantConfig`` keeps its blocks (memory near the file's size) and computes exactly
  what the dequantized float32 model computes: the reference method dequantizes the same blocks
  with the same dequantizer, so logits are bitwise equal. A wrong row order (the llama Q/K
  un-permutation on raw blocks), a shard placed wrongly in a fused layer, or a quantized
  embedding/LM head read wrongly changes them.
- int8 / int4: a small random Llama saved as safetensors, quantized on load; its logits stay
  within the quantization error of the float model's (relative RMS), and the linear layers hold
  only int8 / packed int4 weights.
- Resolution and validation of ``model.quantization``: which config each value gives on which
  platform and model, and the errors that name the field and the allowed values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType

from kiln.config import KilnConfig, ModelConfig
from kiln.engine.arg_utils import EngineArgs
from kiln.model_executor.layers.linear import LinearBase
from kiln.model_executor.layers.quantization import (
    GGUFQuantConfig,
    GGUFWeight,
    Int4QuantConfig,
    Int8QuantConfig,
    dequantize_int4,
    dequantize_int8,
    model_weight_bytes,
    quantize_int4,
    quantize_int8,
)
from kiln.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from kiln.model_executor.loader import get_loader
from kiln.model_executor.model_loader import load_model, resolve_quant_config
from kiln.platforms.cpu import CpuPlatform
from kiln.testing.models import save_tiny_model

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [42, 9, 1200, 33, 7, 7, 7, 88, 2002]]


class QuantizingCpuPlatform(CpuPlatform):
    """The reference cpu platform, declaring every method (Kiln's reference methods)."""

    name = "quantizing-cpu"
    supported_quantization = ("gguf", "int8", "int4")


@pytest.fixture(scope="module")
def dense_and_gguf(gguf_path):
    dense, _ = load_model(gguf_path, torch.float32, quantization="none")
    quantized, _ = load_model(gguf_path, torch.float32, quant_config=GGUFQuantConfig())
    return dense, quantized


def test_gguf_blocks_are_kept_near_the_file_size(dense_and_gguf, gguf_path) -> None:
    dense, quantized = dense_and_gguf
    file_bytes = os.path.getsize(gguf_path)
    assert model_weight_bytes(quantized) <= 1.3 * file_bytes
    assert model_weight_bytes(dense) > 1.3 * file_bytes  # the bound is one dequantizing breaks
    kinds = {}
    for name, module in quantized.named_modules():
        if isinstance(module, LinearBase | VocabParallelEmbedding) and module.quant_method:
            if getattr(module, "_tied_to", ()):
                continue
            (qtype, packed), *rest = module.gguf_parts
            assert not rest and isinstance(packed, GGUFWeight), name
            assert not hasattr(module, "weight"), name  # no dense copy left
            kinds[name.rsplit(".", 1)[-1]] = qtype
    # The file: Q4_1 linears, token_embd Q8_0 (tied as the LM head).
    assert kinds == {
        "qkv_proj": GGMLQuantizationType.Q4_1,
        "o_proj": GGMLQuantizationType.Q4_1,
        "gate_up_proj": GGMLQuantizationType.Q4_1,
        "down_proj": GGMLQuantizationType.Q4_1,
        "embed_tokens": GGMLQuantizationType.Q8_0,
    }
    assert quantized.lm_head.weight_layer() is quantized.model.embed_tokens


def test_gguf_reference_equals_dequantized_float32(dense_and_gguf, paged_runner) -> None:
    dense, quantized = dense_and_gguf
    batch = [(str(i), p) for i, p in enumerate(PROMPTS)]
    want = paged_runner(dense).step(batch)
    got = paged_runner(quantized).step(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert paged_runner(quantized).greedy(PROMPTS, 8) == paged_runner(dense).greedy(PROMPTS, 8)


def test_gguf_model_memory_in_a_fresh_process(gguf_path) -> None:
    """Resident memory the load adds is within 1.3x of the file (measured: 1.17x; the dequantized
    model: 5.6x). A first load, dropped, pays the process's one-time costs (imports, first ops);
    ``malloc_trim`` hands freed heap back before each reading, so neither that load's freed
    memory (reused by the second) nor the load's freed temporaries hide or inflate the figure."""
    script = f"""
import ctypes, gc, json, os, torch
from kiln.model_executor.model_loader import load_model
from kiln.model_executor.layers.quantization import GGUFQuantConfig
def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
load_model({gguf_path!r}, torch.float32, quant_config=GGUFQuantConfig())
before = rss()
model, _ = load_model({gguf_path!r}, torch.float32, quant_config=GGUFQuantConfig())
print(json.dumps({{"delta": rss() - before}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=600
    )
    delta = json.loads(out.stdout.strip().splitlines()[-1])["delta"]
    assert delta <= 1.3 * os.path.getsize(gguf_path), delta


# -- int8 / int4 on a small random float model ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), initializer_range=0.05)


@pytest.mark.parametrize(
    ("quant_config", "buffers"),
    [(Int8QuantConfig(), {"qweight": torch.int8}), (Int4QuantConfig(), {"qweight": torch.uint8})],
    ids=["int8", "int4"],
)
def test_int_quantized_on_load(tiny_llama, paged_runner, quant_config, buffers) -> None:
    dense, _ = load_model(tiny_llama, torch.float32)
    quantized, _ = load_model(tiny_llama, torch.float32, quant_config=quant_config)
    linears = [m for m in quantized.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8
    for layer in linears:
        assert not hasattr(layer, "weight")
        for name, dtype in buffers.items():
            assert getattr(layer, name).dtype == dtype
    batch = [(str(i), [t % 256 for t in p]) for i, p in enumerate(PROMPTS)]
    want = paged_runner(dense).step(batch)
    got = paged_runner(quantized).step(batch)
    # Relative RMS error of the logits. Per weight, rounding costs about step / sqrt(12): ~0.3%
    # of a row's range in int8, ~8% of a 32-group's range in int4 (random Gaussian weights, the
    # worst case); two layers and the head compound it (measured: 1.5% and 17%).
    error = (got - want).norm() / want.norm()
    assert 0 < error < (0.05 if quant_config.name == "int8" else 0.35), error
    assert model_weight_bytes(quantized) < model_weight_bytes(dense)


def test_int8_error_is_at_most_half_a_step() -> None:
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    weight[3] = 0  # an all-zero row stays zero
    qweight, scales = quantize_int8(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantize_int8(qweight, scales) - weight).abs() <= step / 2 + 1e-7).all()
    assert (dequantize_int8(qweight, scales)[3] == 0).all()


def test_int4_error_is_at_most_half_a_step_per_group() -> None:
    weight = torch.randn(8, 96, generator=torch.Generator().manual_seed(0))
    qweight, scales, zeros = quantize_int4(weight, group_size=32)
    assert qweight.shape == (8, 48) and scales.shape == zeros.shape == (8, 3)
    groups = weight.reshape(8, 3, 32)
    step = (groups.amax(dim=2) - groups.amin(dim=2)) / 15
    error = (dequantize_int4(qweight, scales, zeros) - weight).abs().reshape(8, 3, 32)
    assert (error <= step[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.zeros(4, 40))


# -- resolution and validation ----------------------------------------------------------------


def test_model_quantization_values() -> None:
    for value in (None, "auto", "gguf", "int8", "int4", "none"):
        assert ModelConfig(quantization=value).quantization == value
    with pytest.raises(ValueError, match=r"model.quantization='fp8' is invalid; allowed: .*int4"):
        ModelConfig(quantization="fp8")
    assert EngineArgs(quantization="int4").create_config().model.quantization == "int4"


def test_cli_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int8"]))
    assert args.create_config().model.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp8"])


def test_platform_refuses_what_it_does_not_support() -> None:
    config = KilnConfig(model=ModelConfig(quantization="int8"))
    with pytest.raises(ValueError, match=r"model.quantization='int8' .* platform 'cpu'; allowed"):
        CpuPlatform.check_and_update_config(config)
    assert QuantizingCpuPlatform.check_and_update_config(config).model.quantization == "int8"
    with pytest.raises(ValueError, match=r"allowed: \['auto', 'none'\]"):
        CpuPlatform.get_quant_config("gguf", config)


def test_resolution(gguf_path, tiny_llama) -> None:
    gguf = get_loader(gguf_path)
    folder = get_loader(tiny_llama)

    def resolve(value, loader, ref, platform):
        config = resolve_quant_config(value, loader, ref, platform)
        return None if config is None else config.name

    # auto keeps a quantized GGUF quantized only where the platform supports it.
    assert resolve(None, gguf, gguf_path, CpuPlatform) is None
    assert resolve("auto", gguf, gguf_path, QuantizingCpuPlatform) == "gguf"
    assert resolve("none", gguf, gguf_path, QuantizingCpuPlatform) is None
    assert resolve("auto", folder, tiny_llama, QuantizingCpuPlatform) is None
    assert resolve("int4", folder, tiny_llama, QuantizingCpuPlatform) == "int4"
    with pytest.raises(ValueError, match="'gguf' needs a quantized GGUF file"):
        resolve("gguf", folder, tiny_llama, QuantizingCpuPlatform)
    with pytest.raises(ValueError, match="already a quantized GGUF file; allowed for it"):
        resolve("int8", gguf, gguf_path, QuantizingCpuPlatform)
    with pytest.raises(ValueError, match="not supported on platform 'cpu'"):
        resolve("gguf", gguf, gguf_path, CpuPlatform)
    # No platform (a model loaded outside an engine): auto is dense, never a platform selected;
    # an explicit method gets Kiln's reference configs.
    assert resolve("auto", gguf, gguf_path, None) is None
    assert type(resolve_quant_config("gguf", gguf, gguf_path, None)) is GGUFQuantConfig
    assert resolve("int8", folder, tiny_llama, None) == "int8"
