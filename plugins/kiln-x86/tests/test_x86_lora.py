"""kiln-x86's ``lora_apply`` kernel against Kiln's reference (``forward_native``): the default
model's shapes, fused layers (block-diagonal B), base-model tokens, slot ranges that do not start
at 0, one slot for every token, and the routing (decode-sized batches to the kernel, prefills to
the reference)."""

import numpy as np
import pytest
import torch
from kiln_x86 import lora

from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.model_executor.layers.lora import LoRAApply, LoRAMapping, random_slots

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not lora.register_x86_lora():
        pytest.fail("kiln-x86's LoRA kernel could not be built here (see the log)")


# The default model's LoRA layers: qkv_proj, o_proj, gate_up_proj, down_proj.
SHAPES = [((576, 192, 192), 576), ((576,), 576), ((1536, 1536), 576), ((576,), 1536)]
INDICES = {
    "mixed": [0, -1, 3, 1, 2, 2, -1, 0, 1, 3, 0, 2, 1, -1, 3, 0],
    "slots 1-2": [2, -1, 1, 2, 1],
    "one slot": [3, 3, 3],
    "one token": [1],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", INDICES)
@pytest.mark.parametrize("slices, in_features", SHAPES)
def test_kernel_matches_the_reference(dtype, case, slices, in_features):
    g = torch.Generator().manual_seed(len(slices) + in_features)
    rank, num_slots = 8, 4
    lora_a, lora_b = random_slots(slices, num_slots, rank, in_features, g)
    lora_a, lora_b = (lora_a / in_features**0.5).to(dtype), (0.1 * lora_b).to(dtype)
    # Rows past a rank-5 adapter's rank are zero in slot 1, as the manager leaves them.
    lora_a[1, 5:rank] = 0
    indices = INDICES[case]
    y = torch.randn(len(indices), sum(slices), generator=g).to(dtype)
    x = torch.randn(len(indices), in_features, generator=g).to(dtype)
    mapping = LoRAMapping(np.array(indices, dtype=np.int64), x.device)
    op = LoRAApply()
    want = op.forward_native(y.clone(), x, lora_a, lora_b, mapping)
    got = lora.lora_apply(op, y.clone(), x, lora_a, lora_b, mapping, slices)
    # Without the slices the kernel reads every column of lora_b: the same result.
    whole = lora.lora_apply(op, y.clone(), x, lora_a, lora_b, mapping)
    torch.testing.assert_close(whole, got, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # The reference rounds the shrink to bfloat16, the kernel keeps float32 sums: one
        # bfloat16 ulp of the result apart.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7)
    base_rows = torch.tensor(indices) < 0
    assert torch.equal(got[base_rows], y[base_rows])


def test_decode_batches_run_the_kernel_and_prefills_the_reference():
    previous = OP_REGISTRY.device_type
    OP_REGISTRY.select_device("cpu")
    try:
        lora_a, lora_b = random_slots((8, 8), 2, 4, 16, torch.Generator().manual_seed(0))
        op = LoRAApply()
        for num_tokens, provider in ((lora.LORA_MAX_TOKENS, "kiln_x86"), (65, "native")):
            mapping = LoRAMapping(np.zeros(num_tokens, dtype=np.int64), torch.device("cpu"))
            args = (torch.zeros(num_tokens, 16), torch.randn(num_tokens, 16), lora_a, lora_b)
            assert op.selected_impl(*args, mapping) == provider, num_tokens
    finally:
        OP_REGISTRY.select_device(previous)
