"""GGUFLoader: config mapping, HF names and shapes, Q/K un-permutation, against transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from kiln.model_executor.loader import get_loader
from kiln.model_executor.loader.gguf_file import GGUFFile
from kiln.model_executor.loader.gguf_loader import GGUFLoader, hf_tensor_name, open_gguf

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 48, 10
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (written from its formula)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_weights(arch: str, tied: bool) -> dict[str, np.ndarray]:
    """A one-layer model's weights in Hugging Face layout (torch order), random."""
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
    }
    if not tied:
        weights["lm_head.weight"] = rand(VOCAB, HIDDEN)
    if arch == "qwen2":
        weights["model.layers.0.self_attn.q_proj.bias"] = rand(HEADS * HEAD_DIM)
        weights["model.layers.0.self_attn.k_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
        weights["model.layers.0.self_attn.v_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
    if arch == "qwen3":
        weights["model.layers.0.self_attn.q_norm.weight"] = rand(HEAD_DIM)
        weights["model.layers.0.self_attn.k_norm.weight"] = rand(HEAD_DIM)
    return weights


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
    "model.layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
    "model.layers.0.self_attn.v_proj.bias": "blk.0.attn_v.bias",
    "model.layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
    "model.layers.0.self_attn.k_norm.weight": "blk.0.attn_k_norm.weight",
}


def write_gguf(
    path: str,
    arch: str,
    weights: dict[str, np.ndarray],
    extra_tensors: dict[str, np.ndarray] | None = None,
    key_length: int | None = None,
    rope_theta: float = 10000.0,
) -> None:
    """Convert HF-layout weights as llama.cpp would: GGUF names, Q/K permuted for llama, the
    embedding Q8_0-quantized."""
    writer = GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.context_length", 2048)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", FFN)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta)
    if key_length is not None:
        writer.add_uint32(f"{arch}.attention.key_length", key_length)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 7)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 8)
    for hf_name, value in weights.items():
        name = GGUF_NAMES[hf_name]
        if arch == "llama" and name.startswith(("blk.0.attn_q.", "blk.0.attn_k.")):
            value = llama_cpp_permute(value, HEADS if ".attn_q." in name else KV_HEADS)
        if name == "token_embd.weight":
            writer.add_tensor(name, quants.quantize(value, T.Q8_0), raw_dtype=T.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(value))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_file_loads_as_the_hf_checkpoint(tmp_path, arch: str) -> None:
    weights = hf_weights(arch, tied=(arch != "qwen3"))
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch, weights)

    loader = GGUFLoader()
    loaded = dict(loader.iter_weights(path, torch.float32))
    assert set(loaded) == set(weights)
    for name, expected in weights.items():
        if name == "model.embed_tokens.weight":  # Q8_0: equal up to the quantization step
            torch.testing.assert_close(loaded[name], torch.from_numpy(expected), atol=0.03, rtol=0)
        else:
            assert torch.equal(loaded[name], torch.from_numpy(expected)), name

    config = loader.load_hf_config(path)
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    assert config["architectures"] == [expected_arch.get(arch, "Qwen3ForCausalLM")]
    assert config["tie_word_embeddings"] is (arch != "qwen3")
    assert config["attention_bias"] is (arch == "qwen2")
    assert (config["hidden_size"], config["intermediate_size"]) == (HIDDEN, FFN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert (config["vocab_size"], config["head_dim"]) == (VOCAB, HEAD_DIM)
    assert (config["bos_token_id"], config["eos_token_id"]) == (7, 8)
    assert config["rms_norm_eps"] == 1e-6 and config["max_position_embeddings"] == 2048


def test_head_dim_comes_from_key_length(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "qwen3", hf_weights("qwen3", tied=False), key_length=16)
    assert GGUFLoader().load_hf_config(path)["head_dim"] == 16


def test_weights_are_cast_to_requested_dtype(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    weights = hf_weights("llama", tied=True)
    write_gguf(path, "llama", weights)
    loaded = dict(GGUFLoader().iter_weights(path, torch.bfloat16))
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(loaded[name], torch.from_numpy(weights[name]).to(torch.bfloat16))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 128
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    divisors = (plain / inv_freq).numpy().astype(np.float32)  # what llama.cpp stores

    path = str(tmp_path / "m.gguf")
    write_gguf(
        path,
        "llama",
        hf_weights("llama", tied=True),
        extra_tensors={"rope_freqs.weight": divisors},
        key_length=head_dim,
        rope_theta=theta,
    )
    loader = GGUFLoader()
    scaling = loader.load_hf_config(path)["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in dict(loader.iter_weights(path, torch.float32))

    # Divisors no Llama 3 parameters produce are refused, not silently mis-roped.
    bad = str(tmp_path / "bad.gguf")
    write_gguf(
        bad,
        "llama",
        hf_weights("llama", tied=True),
        extra_tensors={"rope_freqs.weight": divisors[::-1].copy()},
        key_length=head_dim,
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        GGUFLoader().load_hf_config(bad)


def test_unsupported_architecture_is_named(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "gemma", hf_weights("llama", tied=True))
    with pytest.raises(ValueError, match="'gemma'.*llama"):
        GGUFLoader().load_hf_config(path)


def test_can_load_and_get_loader(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "llama", hf_weights("llama", tied=True))
    renamed = tmp_path / "model.bin"
    renamed.write_bytes((tmp_path / "m.gguf").read_bytes())
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04 not gguf")

    assert GGUFLoader.can_load(path) and GGUFLoader.can_load(str(renamed))
    assert not GGUFLoader.can_load(str(other))
    assert not GGUFLoader.can_load(str(tmp_path))
    assert not GGUFLoader.can_load(str(tmp_path / "missing.gguf"))
    assert isinstance(get_loader(path), GGUFLoader)
    assert GGUFLoader().tokenizer_source(path) == path


def test_hf_tensor_names() -> None:
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.slow
def test_default_model_config(default_gguf: str) -> None:
    config = GGUFLoader().load_hf_config(default_gguf)
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "attention_bias": False,
        "hidden_act": "silu",
    }


@pytest.mark.slow
def test_default_model_shapes(kiln_gguf_weights: dict[str, torch.Tensor]) -> None:
    w = kiln_gguf_weights
    assert len(w) == 2 + 30 * 9  # embedding, final norm, 9 tensors per layer; lm_head is tied
    assert "lm_head.weight" not in w
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.0.mlp.gate_proj.weight"].shape == (1536, 576)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert w["model.norm.weight"].shape == (576,)


@pytest.mark.slow
def test_default_model_weights_equal_transformers(
    default_gguf: str,
    kiln_gguf_weights: dict[str, torch.Tensor],
    hf_gguf_weights: dict[str, torch.Tensor],
) -> None:
    assert len(hf_gguf_weights) == 2 + 2 * 9  # embedding, norm, layers 0-1
    assert "model.layers.1.self_attn.k_proj.weight" in hf_gguf_weights
    for name, expected in hf_gguf_weights.items():
        assert torch.equal(kiln_gguf_weights[name], expected), name

    # The un-permutation is what makes q/k equal: the file's raw rows are in another order.
    reader = open_gguf(default_gguf)
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    from kiln.model_executor.loader.dequant import dequantize

    raw = torch.from_numpy(dequantize(raw_q.data, raw_q.tensor_type))
    assert not torch.equal(raw, hf_gguf_weights["model.layers.0.self_attn.q_proj.weight"])


def test_reader_is_cached_per_loader(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "llama", hf_weights("llama", tied=True))
    loader = GGUFLoader()
    assert loader.reader(path) is loader.reader(os.path.join(str(tmp_path), ".", "m.gguf"))
    with pytest.raises(FileNotFoundError):
        loader.reader(str(tmp_path / "missing.gguf"))


def test_reader_is_parsed_once_per_process_and_file_version(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    write_gguf(path, "llama", hf_weights("llama", tied=True))
    first = open_gguf(path)
    # Another loader (the engine's, beside the front end's) and another spelling of the path.
    assert GGUFLoader().reader(os.path.join(str(tmp_path), ".", "m.gguf")) is first
    write_gguf(path, "llama", hf_weights("llama", tied=True), rope_theta=500000.0)
    second = open_gguf(path)
    assert second is not first
    assert second.fields["llama.rope.freq_base"].contents() == 500000.0


def _assert_parses_like_gguf_reader(path: str) -> None:
    from gguf import GGUFReader

    plain, ours = GGUFReader(path), GGUFFile(path)
    # GGUFReader also lists the header's counts as GGUF.version, GGUF.tensor_count, GGUF.kv_count.
    header = {"GGUF.version": 3, "GGUF.tensor_count": len(plain.tensors)}
    assert {key: plain.fields[key].contents() for key in header} == header
    metadata = {key: field for key, field in plain.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields) == list(metadata)
    for key, field in metadata.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in plain.tensors]
    for mine, theirs in zip(ours.tensors, plain.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        np.testing.assert_array_equal(mine.data, theirs.data)


def test_gguf_file_parses_like_gguf_reader(tmp_path) -> None:
    """Every value type, arrays of each, and float, integer, bf16 and block-quantized tensors."""
    path = str(tmp_path / "m.gguf")
    rng = np.random.default_rng(0)
    extra = {
        "f16.weight": rng.standard_normal((4, 64)).astype(np.float16),
        "i32.weight": np.arange(12, dtype=np.int32).reshape(3, 4),
        "i8.weight": np.arange(-8, 8, dtype=np.int8),
    }
    write_gguf(path, "qwen2", hf_weights("qwen2", tied=False), extra_tensors=extra)
    writer = GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    for kind in GGUFValueType:
        if kind in (GGUFValueType.ARRAY, GGUFValueType.STRING):
            continue
        value = 1.5 if "FLOAT" in kind.name else (True if kind == GGUFValueType.BOOL else 7)
        writer.add_key_value(f"scalar.{kind.name}", value, kind)
        writer.add_key_value(f"array.{kind.name}", [value, value], GGUFValueType.ARRAY, kind)
    writer.add_key_value("text", "héllo", GGUFValueType.STRING)
    writer.add_key_value("texts", ["a", "", "ü"], GGUFValueType.ARRAY, GGUFValueType.STRING)
    bf16 = rng.standard_normal((2, 32)).astype(np.float32)
    writer.add_tensor("bf16.weight", quants.quantize(bf16, T.BF16), raw_dtype=T.BF16)
    writer.add_tensor("q4_0.weight", quants.quantize(bf16, T.Q4_0), raw_dtype=T.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_parses_like_gguf_reader(path)
    _assert_parses_like_gguf_reader(str(tmp_path / "types.gguf"))


@pytest.mark.slow
def test_gguf_file_parses_the_default_model_like_gguf_reader(default_gguf: str) -> None:
    """~100k vocabulary and merge strings, float score arrays, Q4_1, Q6_K and F32 tensors."""
    _assert_parses_like_gguf_reader(default_gguf)


def test_bad_gguf_files_are_value_errors(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(str(path), "llama", hf_weights("llama", tied=True))
    whole = path.read_bytes()
    for name, data, needle in [
        ("truncated", whole[:200], "is truncated"),
        ("version", whole[:4] + (1).to_bytes(4, "little") + whole[8:], "has version 1"),
        ("big-endian", whole[:4] + (3).to_bytes(4, "big") + whole[8:], "big-endian"),
        ("magic", b"GGML" + whole[4:], "no 'GGUF' magic"),
    ]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=needle):
            GGUFFile(str(bad))


# Hugging Face module names -> llama.cpp's, in a Gemma block (written from gguf's tensor map).
GEMMA_LAYER_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gemma_gguf(path: str, arch: str, hf_model: torch.nn.Module) -> None:
    """A Hugging Face Gemma model as llama.cpp's converter writes it: GGUF names, norm weights
    stored as ``1 + w``, the soft caps, window and head size in the metadata, float32 tensors."""
    cfg = hf_model.config
    writer = GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if rope.get("rope_type", "default") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None):
            writer.add_float32(f"{arch}.{key}", getattr(cfg, key))
    for name, tensor in hf_model.state_dict().items():
        value = tensor.float().numpy()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            value = value + 1
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{GEMMA_LAYER_GGUF[module]}.weight"
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GEMMA_GGUF = {
    # GGUF holds no query_pre_attn_scalar (llama.cpp: head_dim), no layer_types (Gemma 2
    # alternates; Gemma 3 globals every 6th layer, its local rotary base 10000).
    "gemma2": dict(num_hidden_layers=2, attn_logit_softcapping=3.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(
        num_hidden_layers=6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


@pytest.mark.parametrize("model_type", list(GEMMA_GGUF))
def test_gemma_gguf_serves_as_its_hf_model(tmp_path, default_gguf, model_type) -> None:
    from transformers import AutoModelForCausalLM

    from kiln import LLM, SamplingParams
    from kiln.testing.models import TINY_GEMMA, save_tiny_model
    from kiln.testing.reference import hf_greedy

    # No layer_types: the config's default pattern, as the GGUF loader assumes it.
    config = {**TINY_GEMMA, "query_pre_attn_scalar": 48, "layer_types": None}
    folder = save_tiny_model(
        tmp_path / "hf", model_type, random_norms=True, **{**config, **GEMMA_GGUF[model_type]}
    )
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    arch = model_type.removesuffix("_text")
    path = str(tmp_path / f"{arch}.gguf")
    write_gemma_gguf(path, arch, hf_model)
    prompts = [[1, 5, 9, 200, 17], [(11 * i) % 251 for i in range(1, 41)]]
    llm = LLM(
        path, tokenizer=default_gguf, dtype="float32", kv_cache_memory=0.02, max_model_len=256
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
