"""kiln-x86's paged attention against Kiln's reference CPU backend, on random paged caches.

Each case builds one step's batch (requests with a cached context of random keys and values in
shuffled blocks, and their new tokens), runs both backends' ``forward`` on copies of the same
cache, and compares the outputs and the written caches. Slots no request owns hold a large
sentinel (the reference masks them; reading one unmasked wrecks the output); the x86 kernel, which
must never read them at all, also runs with NaN there. float32 must agree to float32 precision;
bfloat16 is compared with the reference run in float32 on the same bfloat16 values: the kernel
accumulates in float32 and rounds only its output, so it must be within bfloat16 rounding of that
(the reference's own bfloat16 path rounds scores and probabilities to bfloat16 too, and is
further off).
"""

from __future__ import annotations

import dataclasses
import random
from types import ModuleType

import pytest
import torch
from kiln_x86.attention import X86AttentionBackend, load_attention_kernels

from kiln.model_executor.layers.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    validate_attention_backend,
)
from kiln.model_executor.layers.attention.backends.cpu import CPUAttentionBackend
from kiln.plugin_api import cpu_flags

pytestmark = pytest.mark.skipif(
    load_attention_kernels() is None, reason="kiln-x86's attention kernel cannot be built here"
)

SENTINEL = 50.0


def run_step(
    backend: type[AttentionBackend],
    cache: torch.Tensor,
    common: CommonAttentionMetadata,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    sliding_window: int | None = None,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """One layer's forward; ``kernels``: another build of the x86 kernel than this machine's."""
    block_size = cache.shape[2]
    impl = backend.get_impl_cls()(
        num_heads, head_size, head_size**-0.5, num_kv_heads, sliding_window=sliding_window
    )
    if kernels is not None:
        impl.kernels = kernels
    metadata = backend.get_metadata_builder_cls()(block_size, "cpu").build(common)
    q, k, v = qkv
    return impl.forward(None, q, k, v, cache, metadata)


def make_step(
    contexts: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_padding: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, CommonAttentionMetadata, tuple[torch.Tensor, ...]]:
    """A cache holding each request's cached tokens, and the step's metadata and inputs.

    Args:
        contexts: per request, (num_computed, query_len), in batch order.
        num_padding: input rows past the requests' tokens (a padded batch).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in contexts]
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(ids[start : start + n])
        start += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), SENTINEL)
    for (computed, _), table in zip(contexts, tables, strict=True):
        for pos in range(computed):
            block, offset = table[pos // block_size], pos % block_size
            cache[:, block, offset] = torch.randn(2, num_kv_heads, head_size, generator=gen)
    query_lens = [q for _, q in contexts]
    common = CommonAttentionMetadata.from_block_tables(
        query_lens, [c for c, _ in contexts], tables, block_size
    )
    num_tokens = sum(query_lens) + num_padding
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    return cache.to(dtype), common, (q.to(dtype), k.to(dtype), v.to(dtype))


def bf16_probabilities() -> bool:
    """Whether bf16 prompt tiles multiply bf16 probabilities by the values (AVX512-BF16)."""
    return "avx512_bf16" in cpu_flags()


def check_against_reference(
    contexts: list[tuple[int, int]],
    num_heads: int = 9,
    num_kv_heads: int = 3,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    kernels: ModuleType | None = None,
    **kwargs,
) -> None:
    cache, common, qkv = make_step(contexts, num_heads, num_kv_heads, dtype=dtype, **kwargs)
    head_size = cache.shape[-1]
    args = (common, num_heads, num_kv_heads, head_size, sliding_window, kernels)
    x86_cache = cache.clone()
    out = run_step(X86AttentionBackend, x86_cache, common, qkv, *args[1:])
    # Reference in float32 on the same (possibly bfloat16) values.
    ref_cache = cache.float()
    qkv32 = tuple(t.float() for t in qkv)
    ref = run_step(CPUAttentionBackend, ref_cache, common, qkv32, *args[1:5])

    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(x86_cache.float(), ref_cache, atol=0, rtol=0)
    n = common.num_actual_tokens
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        # Within the output's bfloat16 rounding (half an ulp, 2^-9 relative) of float32 maths,
        # plus, where prompt rows' probabilities are rounded to bfloat16 for the value product
        # (AVX512-BF16), 2^-9 of each probability: at most 2^-9 max|v| on an output element.
        values = torch.cat([qkv32[2].flatten(), ref_cache[1][ref_cache[1] != SENTINEL]])
        atol = 1e-3 + (2**-9 * values.abs().max().item() if bf16_probabilities() else 0.0)
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=2**-8)

    # Unowned and not-yet-written slots are never read: NaN there changes nothing.
    nan_cache = cache.clone()
    written = torch.zeros(nan_cache[0].numel() // nan_cache[0, 0, 0].numel(), dtype=torch.bool)
    written[common.slot_mapping] = True
    owned = (cache != SENTINEL).any(-1).any(-1).any(0).flatten() | written
    nan_cache.view(2, -1, num_kv_heads, head_size)[:, ~owned] = float("nan")
    out_nan = run_step(X86AttentionBackend, nan_cache, common, qkv, *args[1:])
    assert torch.equal(out_nan, out)


HEADS = [(9, 3), (5, 5), (6, 2)]  # SmolLM2's GQA (group 3, odd heads), MHA, GQA on even heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_decode_batch_of_mixed_lengths(dtype, num_heads: int, num_kv_heads: int) -> None:
    # Contexts of 1, the block edges (15, 16, 17 tokens after the step) and a long one.
    contexts = [(0, 1), (14, 1), (15, 1), (16, 1), (700, 1), (40, 1)]
    check_against_reference(contexts, num_heads, num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [300, 1024, 1500])
def test_long_decode_split_over_the_context(dtype, seq_len: int) -> None:
    # One or two decodes: too few (request, kv head) pairs, so the context is split and merged.
    check_against_reference([(seq_len - 1, 1)], dtype=dtype)
    check_against_reference([(seq_len - 1, 1), (seq_len // 3, 1)], 9, 3, dtype=dtype, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_without_and_with_a_cached_prefix(dtype, num_heads: int, num_kv_heads: int) -> None:
    check_against_reference([(0, 37)], num_heads, num_kv_heads, dtype=dtype)  # nothing cached
    check_against_reference([(48, 20)], num_heads, num_kv_heads, dtype=dtype)  # prefix-cache hit
    check_against_reference([(37, 70)], num_heads, num_kv_heads, dtype=dtype)  # a later chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_in_any_order_with_padding(dtype) -> None:
    contexts = [(20, 1), (33, 17), (0, 1), (0, 45), (128, 1), (16, 16), (5, 2)]
    check_against_reference(contexts, dtype=dtype, num_padding=3)
    check_against_reference(contexts[::-1], dtype=dtype, num_padding=0, seed=2)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_other_block_sizes(block_size: int) -> None:
    contexts = [(40, 1), (3, 1), (30, 9), (0, 6), (300, 1)]
    check_against_reference(contexts, block_size=block_size)


def test_other_head_size() -> None:
    check_against_reference([(40, 1), (30, 9), (0, 1)], 4, 2, head_size=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(dtype) -> None:
    contexts = [(40, 1), (700, 1), (30, 25), (0, 40), (5, 1)]
    check_against_reference(contexts, dtype=dtype, sliding_window=13)
    check_against_reference([(900, 1)], dtype=dtype, sliding_window=300)  # split decode


def test_empty_step() -> None:
    check_against_reference([], num_padding=2)


def test_backend_passes_the_interface_check() -> None:
    assert validate_attention_backend(X86AttentionBackend) is X86AttentionBackend
    assert X86AttentionBackend.get_kv_cache_shape(
        7, 16, 3, 64
    ) == CPUAttentionBackend.get_kv_cache_shape(7, 16, 3, 64)


def test_platform_names_it_except_for_batch_invariance_and_float16() -> None:
    from kiln_x86.platform import X86Platform

    from kiln.engine.arg_utils import EngineArgs

    def backend(**kwargs) -> str:
        return X86Platform.get_attn_backend_cls(EngineArgs(**kwargs).create_config())

    assert backend() == backend(dtype="float32") == "kiln_x86.attention.X86AttentionBackend"
    assert backend(dtype="float16").endswith("cpu.CPUAttentionBackend")
    assert backend(batch_invariant=True).endswith("CPUBatchInvariantAttentionBackend")


def test_without_the_kernel_it_runs_the_reference(monkeypatch) -> None:
    from kiln_x86 import kernels

    monkeypatch.setitem(kernels._STATE, "kiln_x86_attention", None)  # as when it cannot build
    cache, common, qkv = make_step([(20, 1), (33, 17)], 9, 3)
    ours = run_step(X86AttentionBackend, cache.clone(), common, qkv, 9, 3, 64)
    ref = run_step(CPUAttentionBackend, cache.clone(), common, qkv, 9, 3, 64)
    assert torch.equal(ours, ref)


@pytest.fixture
def two_threads():
    """Two torch threads, so that long decodes of few requests are split over the context."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


# The decode kernel walks the context 16 positions at a time: lengths around those steps and the
# block edges, one token, a length of no multiple of either, and a batch of all of them.
DECODE_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 200, 257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (3, 3)])  # GQA ratios 3 and 1
@pytest.mark.parametrize("block_size", [16, 5, 32])
def test_decode_context_lengths(dtype, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    for seq_len in DECODE_LENGTHS:  # each alone
        check_against_reference(
            [(seq_len - 1, 1)], num_heads, num_kv_heads, dtype=dtype, block_size=block_size
        )
    batch = [(seq_len - 1, 1) for seq_len in DECODE_LENGTHS]
    random.Random(3).shuffle(batch)
    check_against_reference(
        batch, num_heads, num_kv_heads, dtype=dtype, block_size=block_size, seed=3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [32, 64, 128, 48])  # 48: the portable kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 1), (7, 1), (4, 2), (2, 2)])
def test_decode_head_sizes_and_groups(dtype, head_size: int, num_heads: int, num_kv_heads: int):
    # Groups of 8 and 7 query heads per KV head take several passes (of up to 4, or 2 for head
    # size 128) over the context.
    contexts = [(0, 1), (40, 1), (16, 1), (130, 1)]
    check_against_reference(contexts, num_heads, num_kv_heads, dtype=dtype, head_size=head_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_at_two_threads(dtype, two_threads) -> None:
    # Few requests with long contexts: split over the context in spans, merged afterwards.
    check_against_reference([(1029, 1)], dtype=dtype)
    check_against_reference([(700, 1), (9, 1)], 9, 3, dtype=dtype, sliding_window=300, seed=1)


@pytest.fixture(scope="module")
def portable_kernels() -> ModuleType:
    """The kernel built as for a CPU without AVX-512 (so without AVX512-BF16): the build a CPU
    with only AVX2 gets, which runs the portable decode (built once per machine, like the
    others)."""
    from kiln_x86.kernels import ATTENTION_CFLAGS, ATTENTION_SOURCE, load_extension

    module = load_extension(
        "kiln_x86_attention_portable", ATTENTION_SOURCE, [*ATTENTION_CFLAGS, "-mno-avx512f"]
    )
    assert module is not None, "the portable build failed"
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_build_without_avx512(dtype, portable_kernels) -> None:
    contexts = [(0, 1), (15, 1), (16, 1), (200, 1), (33, 17), (0, 9)]
    check_against_reference(contexts, dtype=dtype, kernels=portable_kernels)
    check_against_reference([(40, 1), (30, 1)], 4, 4, dtype=dtype, kernels=portable_kernels)


def with_prompts(
    common: CommonAttentionMetadata, prompt_lens: list[int]
) -> CommonAttentionMetadata:
    """``common`` with each request's prompt length given, as the model runner gives it."""
    return dataclasses.replace(
        common, num_prompt_tokens=torch.tensor(prompt_lens, dtype=torch.int32)
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context", [100, 255, 256, 500, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_generated_rows_equal_the_same_rows_decoded_one_by_one(context, dtype, threads) -> None:
    """A speculative step's verification (5 new rows of one request past its prompt, beside
    another decode) gives every row exactly what a decode step at that row's position gives, bit
    for bit, on any thread count: greedy speculation then keeps the tokens of no speculation in
    bfloat16 too. (At 2 threads a plain decode of a long context is split over it, a step of 6
    decodes was not: a decode's split must not depend on the step.)"""
    rows = 5
    cache, common, (q, k, v) = make_step(
        [(context, rows), (37, 1)], 9, 3, dtype=dtype, seed=context
    )
    common = with_prompts(common, [context - 7, 20])
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = run_step(X86AttentionBackend, cache.clone(), common, (q, k, v), 9, 3, 64)
        one_by_one = cache.clone()
        table = common.block_table[0, : -(-(context + rows) // 16)].tolist()
        for j in range(rows):
            step = CommonAttentionMetadata.from_block_tables([1], [context + j], [table], 16)
            step = with_prompts(step, [context - 7])
            qkv_j = (q[j : j + 1], k[j : j + 1], v[j : j + 1])
            out = run_step(X86AttentionBackend, one_by_one, step, qkv_j, 9, 3, 64)
            assert torch.equal(out[0], together[j]), f"row {j}"
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(
    "prompt_len,cached",
    # (37, 32): the chat test's repeated question; then tails past one 64-row tile; (33, 32): one
    # prompt row left; (600, 16), (600, 272): rows past a 256-key chunk
    [
        (37, 32),
        (37, 16),
        (100, 96),
        (20, 16),
        (100, 32),
        (200, 16),
        (33, 32),
        (600, 16),
        (600, 272),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 300])
def test_prefix_cache_hit_rows_equal_the_whole_prompts(
    prompt_len, cached, dtype, sliding_window
) -> None:
    """A prefix-cache hit's remaining prompt rows (a few, as a verification has) get the bits the
    whole prompt's prefill gave them: a repeated greedy question gets the same answer. They stay
    prefill rows: computed as decodes, they rounded differently, and a near-tie first token of a
    repeated chat question flipped ("Paris" -> "L'Étoile"). On every CPU: no product's rounding
    may depend on the tile's row or key count (MKL's did on an AMD EPYC), nor, with a sliding
    window, the key chunks on where the tile starts."""
    check_prefix_hit(prompt_len, cached, dtype, sliding_window)


@pytest.mark.parametrize("prompt_len,cached", [(100, 32), (33, 32), (600, 272)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefix_cache_hit_rows_equal_on_every_build(
    prompt_len, cached, dtype, portable_kernels
) -> None:
    """The same with a head size that is no multiple of 16 (padded inside the tile), and with
    the build an AVX2-only CPU gets (its own products, without AVX512-BF16)."""
    check_prefix_hit(prompt_len, cached, dtype, None, head_size=80)
    check_prefix_hit(prompt_len, cached, dtype, 300, kernels=portable_kernels)
    check_prefix_hit(prompt_len, cached, dtype, None, head_size=80, kernels=portable_kernels)


def check_prefix_hit(
    prompt_len: int,
    cached: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    head_size: int = 64,
    kernels: ModuleType | None = None,
) -> None:
    cache, common, (q, k, v) = make_step(
        [(0, prompt_len)], 9, 3, head_size, dtype=dtype, seed=prompt_len
    )
    whole_cache = cache.clone()
    shape = (9, 3, head_size, sliding_window, kernels)
    whole = run_step(
        X86AttentionBackend, whole_cache, with_prompts(common, [prompt_len]), (q, k, v), *shape
    )
    table = common.block_table[0].tolist()
    hit = CommonAttentionMetadata.from_block_tables([prompt_len - cached], [cached], [table], 16)
    hit = with_prompts(hit, [prompt_len])
    new = (q[cached:], k[cached:], v[cached:])
    rows = run_step(X86AttentionBackend, whole_cache.clone(), hit, new, *shape)
    assert torch.equal(rows, whole[cached:])


@pytest.fixture
def pool_helper():
    """One helper thread in the work pool the attention kernel shares with the matmuls."""
    from kiln_x86 import gemv

    pool = gemv.load_gemv_kernels()
    assert load_attention_kernels() is not None
    pool.set_pool_helpers([-1])
    assert pool.pool_helpers() == 1
    yield
    pool.set_pool_helpers([])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_threads_and_pool_helpers_give_the_same_bits(dtype, pool_helper) -> None:
    """A step of two prompts (one on a cached prefix), a long decode (split over its context)
    and short decodes gives the same bits whether its packing and items run on the calling
    thread alone, with the work pool's helper (the default on 2 cores), or on two torch threads
    (the kernel is built with OpenMP, so at::parallel_for there is a team of two)."""
    from kiln_x86 import gemv

    contexts = [(0, 300), (272, 330), (700, 1), (30, 1), (5, 1)]
    cache, common, qkv = make_step(contexts, 9, 3, dtype=dtype, seed=7)
    common = with_prompts(common, [300, 602, 40, 20, 3])
    with_helper = run_step(X86AttentionBackend, cache.clone(), common, qkv, 9, 3, 64)
    gemv.load_gemv_kernels().set_pool_helpers([])
    alone = run_step(X86AttentionBackend, cache.clone(), common, qkv, 9, 3, 64)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two_threads = run_step(X86AttentionBackend, cache.clone(), common, qkv, 9, 3, 64)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(with_helper, alone)
    assert torch.equal(two_threads, alone)
    ref = run_step(
        CPUAttentionBackend, cache.float(), common, tuple(t.float() for t in qkv), 9, 3, 64
    )
    torch.testing.assert_close(alone.float(), ref, atol=2e-2, rtol=2e-2)
