"""The fused kernels against Kiln's reference ops (``forward_native``) beyond the kit's examples:
odd sizes, strided inputs, the default model's real shapes and weights. add + RMSNorm and
SiLU-and-mul are bit-identical; rotary follows the reference's roundings (float32 to float32
precision, bfloat16 bit-identical but for rare last-bit differences)."""

import pytest
import torch
from kiln_x86 import ops

from kiln.model_executor.layers.activation import SiluAndMul
from kiln.model_executor.layers.layernorm import RMSNorm
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not ops.register_x86_ops():
        pytest.fail("kiln-x86's C++ kernels could not be built here (see the log)")


def _check(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        # One bf16 ulp at most, and nearly every element bit-identical: the kernel rounds where
        # the reference rounds.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
        assert got.numel() == 0 or (got == want).float().mean() > 0.99


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden", [(1, 576), (3, 97), (17, 576), (0, 64), (130, 1)])
def test_rms_norm_with_and_without_residual(dtype, tokens, hidden):
    g = _gen(tokens + hidden)
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    x = (3 * torch.randn(tokens, hidden, generator=g)).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    # The reference's ops in its order: bitwise equal in both dtypes (Kiln's layer tests hold the
    # norm to bitwise equality with Hugging Face's).
    assert torch.equal(ops.rms_norm(norm, x.clone()), norm.forward_native(x.clone()))
    got, got_sum = ops.rms_norm(norm, x.clone(), residual.clone())
    want, want_sum = norm.forward_native(x.clone(), residual.clone())
    assert torch.equal(got, want) and torch.equal(got_sum, want_sum)


def test_rms_norm_per_head_and_strided_input():
    g = _gen(1)
    norm = RMSNorm(32, 1e-6)
    x = torch.randn(5, 4, 32, generator=g)  # Qwen3's q/k norm: [T, H, D]
    assert torch.equal(ops.rms_norm(norm, x), norm.forward_native(x))
    wide = torch.randn(6, 64, generator=g)[:, :32]  # rows with a stride of 64
    assert torch.equal(ops.rms_norm(norm, wide), norm.forward_native(wide))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, d", [(1, 1536), (7, 48), (33, 5), (0, 8)])
def test_silu_and_mul(dtype, tokens, d):
    x = (4 * torch.randn(tokens, 2 * d, generator=_gen(d))).to(dtype)
    op = SiluAndMul()
    # ATen's own kernels in the same order: identical in both dtypes.
    assert torch.equal(ops.silu_and_mul(op, x), op.forward_native(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, head_dim, scaling",
    [
        (1, 9, 3, 64, None),
        (19, 4, 1, 6, None),
        (5, 2, 2, 128, {"rope_type": "linear", "factor": 4.0}),
    ],
)
def test_rotary_embedding(dtype, tokens, heads, kv_heads, head_dim, scaling):
    g = _gen(tokens * head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 100000.0, scaling, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    q = torch.randn(tokens, heads * head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads * head_dim, generator=g).to(dtype)
    got_q, got_k = ops.rotary_embedding(rope, positions, q, k)
    want_q, want_k = rope.forward_native(positions, q, k)
    _check(got_q, want_q, dtype)
    _check(got_k, want_k, dtype)


def test_rotary_refuses_positions_outside_the_cache():
    rope = RotaryEmbedding(8, 16)
    q = k = torch.randn(1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        ops.rotary_embedding(rope, torch.tensor([16]), q, k)


def test_the_default_models_norm_weights(gguf_path):
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    weight = torch.from_numpy(tensors["blk.0.attn_norm.weight"].data.copy()).float()
    norm = RMSNorm(weight.numel(), 1e-5)
    norm.weight.data.copy_(weight)
    x, residual = torch.randn(2, 16, weight.numel(), generator=_gen(7))
    got, _ = ops.rms_norm(norm, x, residual)
    want, _ = norm.forward_native(x, residual)
    assert torch.equal(got, want)


def test_kernels_take_only_cpu_float32_and_bfloat16_calls():
    norm = RMSNorm(8, 1e-6, torch.bfloat16)
    x = torch.randn(2, 8).bfloat16()
    assert ops._rms_norm_supports(norm, x)
    assert ops._rms_norm_supports(norm, x, x.clone())
    assert not ops._rms_norm_supports(norm, x, x.float())  # residual of another dtype
    assert not ops._rms_norm_supports(norm, x.half())
    assert ops._silu_supports(None, x.float())
    assert not ops._silu_supports(None, x.half())
    assert not ops._silu_supports(None, x.to(torch.int64))
    assert not ops._silu_supports(None, torch.empty(2, 8, device="meta"))  # not on the CPU


def test_tiled_gguf_layers_call_the_kernel_directly(gguf_path):
    from kiln_x86 import gemv
    from kiln_x86.linear_methods import X86GGUFInt8ActivationsLinearMethod

    from kiln.model_executor.custom_op import OP_REGISTRY
    from kiln.model_executor.layers.quantization import GGUFQuantConfig
    from kiln.model_executor.model_loader import load_model

    if not gemv.available():
        pytest.skip("the tiled int8 kernel needs AVX512-VNNI")
    config = GGUFQuantConfig(X86GGUFInt8ActivationsLinearMethod)
    model, _ = load_model(gguf_path, torch.bfloat16, quant_config=config)
    previous = OP_REGISTRY.device_type
    OP_REGISTRY.select_device("cpu")
    try:
        gen = _gen(3)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer = model.get_submodule(f"model.layers.5.{name}")
            for rows in (1, 16, 64, 65, 130):  # the decode kernel's rows, and AMX's
                x = torch.randn(rows, layer.input_size, generator=gen).bfloat16()
                assert layer.selected_impl(x) == ops.PROVIDER
                assert torch.equal(layer(x), layer.forward_native(x)), (name, rows)
    finally:
        OP_REGISTRY.select_device(previous)
