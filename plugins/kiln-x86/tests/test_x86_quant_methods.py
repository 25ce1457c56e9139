"""kiln-x86's quantized linear methods (``kiln_x86.linear_methods``) through Kiln's quant_config
path, against Kiln's reference methods (``kiln.model_executor.layers.quantization``).

- GGUF: the default model loaded with the exact method (``x86.int8_activations`` off) keeps
  every weight in ``kiln_x86.quant``'s layout, within 1.3x of the file's size, and its layers
  (fused linears, quantized embedding, tied LM head) agree with the reference's in float32 (the
  default int8 method: ``test_x86_quant_tiled.py``).
- int8 / int4 on a small random Llama: the platform's torch kernels agree with the reference
  methods' dequantized products on the same quantized weights.
- Perplexity (slow, two fresh processes): the default model as x86 runs it by default (kept
  quantized, bfloat16) is within 1% of the dequantized float32 model on the reference platform.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kiln_x86 import gemv, quant
from kiln_x86.linear_methods import (
    X86GGUFLinearMethod,
    X86Int4LinearMethod,
    X86Int8ActivationsLinearMethod,
    X86Int8LinearMethod,
)
from kiln_x86.platform import X86Platform

from kiln.model_executor.layers.linear import LinearBase
from kiln.model_executor.layers.quantization import (
    GGUFQuantConfig,
    Int4QuantConfig,
    Int8QuantConfig,
    model_weight_bytes,
)
from kiln.model_executor.model_loader import load_model
from kiln.testing.models import save_tiny_model


@pytest.fixture(scope="module")
def reference_and_x86(gguf_path):
    reference, _ = load_model(gguf_path, torch.float32, quant_config=GGUFQuantConfig())
    x86, _ = load_model(gguf_path, torch.float32, quant_config=GGUFQuantConfig(X86GGUFLinearMethod))
    return reference, x86


def test_gguf_weights_stay_in_the_kernels_layout(reference_and_x86, gguf_path) -> None:
    _, x86 = reference_and_x86
    assert model_weight_bytes(x86) <= 1.3 * os.path.getsize(gguf_path)
    packed = [
        module.gguf_parts
        for module in x86.modules()
        if getattr(module, "quant_method", None) and not getattr(module, "_tied_to", ())
    ]
    assert len(packed) == 30 * 4 + 1  # qkv, o, gate_up, down per layer; the embedding
    assert all(len(parts) == 1 and isinstance(parts[0][1], quant.PackedWeight) for parts in packed)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # the kernel's rows, and above them
def test_gguf_layers_agree_with_the_reference(reference_and_x86, num_tokens) -> None:
    # The float kernels, exact but for the order of sums: this checks the layers' wiring. The
    # int8 kernels (activations rounded, the default) are bounded against the reference in
    # test_x86_quant.py and test_x86_quant_tiled.py.
    reference, x86 = reference_and_x86
    gen = torch.Generator().manual_seed(num_tokens)
    layer = 7
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        want_layer = reference.get_submodule(f"model.layers.{layer}.{name}")
        got_layer = x86.get_submodule(f"model.layers.{layer}.{name}")
        x = torch.randn(num_tokens, want_layer.input_size, generator=gen)
        torch.testing.assert_close(got_layer(x), want_layer(x), rtol=1e-4, atol=1e-4)
    ids = torch.randint(0, 49152, (num_tokens,), generator=gen)
    torch.testing.assert_close(
        x86.model.embed_tokens(ids), reference.model.embed_tokens(ids), rtol=0, atol=0
    )
    hidden = torch.randn(num_tokens, 576, generator=gen)
    torch.testing.assert_close(
        x86.compute_logits(hidden), reference.compute_logits(hidden), rtol=1e-4, atol=1e-4
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize(
    ("reference_config", "method_cls"),
    [
        (Int8QuantConfig(), X86Int8ActivationsLinearMethod),
        (Int4QuantConfig(), X86Int4LinearMethod),
    ],
    ids=["int8", "int4"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_methods_agree_with_the_reference(
    tiny_llama, reference_config, method_cls, dtype
) -> None:
    reference, _ = load_model(tiny_llama, dtype, quant_config=reference_config)
    x86_config = X86Platform.get_quant_config(reference_config.name, None)
    x86, _ = load_model(tiny_llama, dtype, quant_config=x86_config)
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    layers = [(n, m) for n, m in x86.named_modules() if isinstance(m, LinearBase)]
    assert layers and all(type(m.quant_method) is method_cls for _, m in layers)
    # int8 activations: bfloat16 layers hold only the tiled int8 weight where the kernel runs;
    # float32 ones (token-for-token comparisons) keep the exact kernel.
    tiled = method_cls is X86Int8ActivationsLinearMethod and dtype == torch.bfloat16
    tiled = tiled and gemv.available()
    assert all(("x86_tiled" in m.__dict__) == tiled for _, m in layers)
    for name, layer in layers:
        for num_tokens in (1, 7):
            x = torch.randn(num_tokens, layer.input_size, generator=gen).to(dtype)
            want = reference.get_submodule(name)(x).float()
            torch.testing.assert_close(layer(x).float(), want, rtol=tol, atol=tol)


_PERPLEXITY = """
import json, sys
from kiln import LLM
from kiln.bench.perplexity import perplexity, read_text
llm = LLM(kv_cache_memory=0.25, **json.loads(sys.argv[1]))
from kiln.platforms import current_platform
ppl, count = perplexity(llm, llm.get_tokenizer().encode(read_text()))
print(json.dumps({"ppl": ppl, "count": count, "platform": current_platform.name}))
"""


def _perplexity(config: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PERPLEXITY, json.dumps(config)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        timeout=1500,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.plugin
def test_perplexity_within_one_percent_of_dequantized_float32() -> None:
    reference = _perplexity({"platform": "cpu", "dtype": "float32", "quantization": "none"})
    x86 = _perplexity({})
    assert (reference["platform"], x86["platform"]) == ("cpu", "x86")
    assert reference["count"] == x86["count"] >= 2000
    assert abs(x86["ppl"] / reference["ppl"] - 1) < 0.01, (x86, reference)


@pytest.fixture
def x86_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``x86`` config section declared, as selecting kiln-x86 declares it, whichever platform
    this process selected (Kiln's own tests, run first in the same pytest process, select
    ``cpu``); the registry is restored after the test."""
    from kiln.plugins.config import PLUGIN_CONFIG_REGISTRY
    from kiln.plugins.registry import Registry

    sections = Registry(PLUGIN_CONFIG_REGISTRY.sections.kind)
    for name, schema in PLUGIN_CONFIG_REGISTRY.sections.items():
        sections.register(name, schema)
    sections.register(X86Platform.name, X86Platform.config_section)
    monkeypatch.setattr(PLUGIN_CONFIG_REGISTRY, "sections", sections)


def test_dense_weights_where_the_kernels_do_not_serve(x86_section) -> None:
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig

    def resolved(**model) -> str | None:
        buckets = model.pop("buckets", None)
        config = KilnConfig(
            model=ModelConfig(**model), device=DeviceConfig(graph_capture_sizes=buckets)
        )
        return X86Platform.check_and_update_config(config).model.quantization

    assert resolved() is None  # auto: the loader keeps a quantized GGUF quantized
    assert resolved(dtype="float32") == "none"  # the exact-comparison mode stays dense
    assert resolved(dtype="float32", quantization="gguf") == "gguf"
    assert resolved(quantization="int4") == "int4"
    assert resolved(batch_invariant=True, dtype="bfloat16") == "none"
    assert resolved(buckets=(1, 2)) is None  # decode graphs trace the GGUF kernels
    assert resolved(quantization="gguf", buckets=(1,)) == "gguf"
    assert resolved(quantization="int8", buckets=(1, 2)) == "int8"
    with pytest.raises(ValueError, match=r"model.quantization='gguf' is invalid with model.batch"):
        resolved(quantization="gguf", batch_invariant=True, dtype="bfloat16")


_INT_LLM = """
import json, sys
from kiln import LLM, SamplingParams
folder, method, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
prompt = {"prompt_token_ids": [(7 * i) % 256 for i in range(1, 40)]}
result = {}
for quantization in ("none", method):
    kwargs = dict(tokenizer=tokenizer, dtype="float32", kv_cache_memory=0.05)
    llm = LLM(folder, quantization=quantization, **kwargs)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    result[quantization] = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
from kiln.platforms import current_platform
result["platform"] = current_platform.name
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.plugin
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_llm_quantization_flag_on_a_float_model(tiny_llama, gguf_path, method) -> None:
    """``LLM(quantization=...)`` in a fresh process where x86 is selected: the prompt's logprobs
    move by no more than the method's rounding allows, and do move."""
    out = subprocess.run(
        [sys.executable, "-c", _INT_LLM, tiny_llama, method, gguf_path],  # its tokenizer
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        timeout=900,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["platform"] == "x86"
    dense, quantized = torch.tensor(result["none"]), torch.tensor(result[method])
    error = (quantized - dense).abs().max().item()
    assert 0 < error < (0.05 if method == "int8" else 0.5), error


@pytest.mark.parametrize(
    ("int8_activations", "method_cls"),
    [(True, X86Int8ActivationsLinearMethod), (False, X86Int8LinearMethod)],
)
def test_int8_activations_choose_the_int8_method(monkeypatch, int8_activations, method_cls):
    from kiln_x86.options import X86Options

    from kiln.config import KilnConfig

    options = X86Options(int8_activations=int8_activations)
    monkeypatch.setattr(X86Platform, "options", classmethod(lambda cls, config: options))
    assert X86Platform.get_quant_config("int8", KilnConfig()).method_cls is method_cls
