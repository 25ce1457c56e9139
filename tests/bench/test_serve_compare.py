"""``benchmarks/serve_compare.py``'s engine plan: Kiln variants (``--kiln-variant``) and the
weights the roofline gives each engine. No server is started."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "serve_compare.py"


@pytest.fixture(scope="module")
def serve_compare():
    spec = importlib.util.spec_from_file_location("serve_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_compare"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_kiln_variants_become_named_engines_with_their_flags(serve_compare):
    variants = serve_compare.parse_kiln_variants(["int8=--quantization int8", "t2=--foo 'a b'"])
    assert variants == [("kiln-int8", ["--quantization", "int8"]), ("kiln-t2", ["--foo", "a b"])]


@pytest.mark.parametrize("item", ["int8", "=--quantization int8", "a b=--x", "x/y=--x"])
def test_a_bad_kiln_variant_names_the_flag(serve_compare, item):
    with pytest.raises(ValueError, match="--kiln-variant"):
        serve_compare.parse_kiln_variants([item])


def test_the_roofline_gives_each_engine_its_weights(serve_compare, gguf_path):
    Engine = serve_compare.Engine
    plan = [
        Engine("kiln", ["kiln", "serve", "folder", "--dtype", "bfloat16"]),
        Engine("kiln-int8", ["kiln", "serve", "folder", "--quantization", "int8"]),
        Engine("kiln-int4", ["kiln", "serve", "folder", "--quantization=int4"]),
        Engine("vllm", ["vllm", "serve", "folder"]),
    ]
    on_hf = serve_compare.engine_models(plan, "bfloat16", kiln_on_hf=True)
    params = on_hf["vllm"].weight_bytes / 2
    assert on_hf["kiln"].weight_bytes == pytest.approx(2 * params)
    assert on_hf["kiln-int8"].weight_bytes == pytest.approx(params)
    assert on_hf["kiln-int4"].weight_bytes == pytest.approx(params / 2)
    on_gguf = serve_compare.engine_models(plan[:1] + plan[3:], "float32", kiln_on_hf=False)
    # Kiln on its GGUF: the file's quantized bytes, well under vLLM's dense float32 ones.
    assert on_gguf["kiln"].weight_bytes < on_gguf["vllm"].weight_bytes / 4
