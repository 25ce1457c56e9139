"""Every op here gives the conformance kit examples, and forward() dispatches to forward_native."""

from __future__ import annotations

import pytest
import torch

from kiln.model_executor.custom_op import OP_REGISTRY
from kiln.model_executor.layers.activation import GeluAndMul, SiluAndMul
from kiln.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from kiln.model_executor.layers.linear import LinearBase
from kiln.model_executor.layers.rotary_embedding import RotaryEmbedding
from kiln.model_executor.layers.vocab_embedding import LogitsProcessor, VocabParallelEmbedding

OPS = {
    "rms_norm": RMSNorm,
    "silu_and_mul": SiluAndMul,
    "gemma_rms_norm": GemmaRMSNorm,
    "gelu_and_mul": GeluAndMul,
    "rotary_embedding": RotaryEmbedding,
    "linear": LinearBase,
    "vocab_parallel_embedding": VocabParallelEmbedding,
    "logits_processor": LogitsProcessor,
}


@pytest.mark.parametrize("name", list(OPS))
def test_op_is_registered_and_has_runnable_examples(name: str) -> None:
    assert OP_REGISTRY.ops.get(name) is OPS[name]
    examples = OPS[name].make_examples(torch.Generator().manual_seed(0))
    assert examples
    for op, args, kwargs in examples:
        assert isinstance(op, OPS[name])
        expected = op.forward_native(*args, **kwargs)
        got = op(*args, **kwargs)  # no provider registered on CPU: the native path
        for e, g in zip(
            expected if isinstance(expected, tuple) else (expected,),
            got if isinstance(got, tuple) else (got,),
            strict=True,
        ):
            assert torch.isfinite(e.float()).all()
            torch.testing.assert_close(g, e, rtol=0, atol=0)
