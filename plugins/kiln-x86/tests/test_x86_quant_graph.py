"""kiln_x86.quant under torch.compile: decode graphs keep GGUF weights in the kernels' layout.

A compiled function of ``quant.matmul`` / ``quant.embedding`` must trace in one graph
(``fullgraph``), run the kernels as ``torch.ops.kiln_x86_quant`` ops, and give the eager call's
result: exactly where the register kernel runs (the same kernel on the same inputs), within
float32 rounding where inductor runs the dense GEMM after the dequantize op.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from kiln_x86 import quant
from test_x86_quant import random_raw

pytestmark = pytest.mark.skipif(
    quant.load_quant_kernels() is None, reason="kiln-x86's quant kernels cannot be built here"
)


def _compiled_events(fn, *args) -> tuple[torch.Tensor, set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, {event.name for event in prof.events()}


@pytest.mark.parametrize(
    ("qtype", "rows", "op", "atol"),
    [
        (T.Q4_1, 1, "kiln_x86_quant::qmatmul", 0.0),  # decode rows: the register kernel
        (T.Q6_K, 12, "kiln_x86_quant::dequantize", 1e-5),  # more rows: dequantize + dense GEMM
    ],
)
def test_matmul_and_embedding_trace_as_ops(qtype, rows, op, atol) -> None:
    out_features, in_features = 48, 256
    packed = quant.pack(
        torch.from_numpy(random_raw(qtype, out_features, in_features)),
        qtype,
        out_features,
        in_features,
    )
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    ids = torch.randint(0, out_features, (rows,), generator=gen)

    def step(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return quant.matmul(x, packed) + quant.embedding(ids, packed, x.dtype)[:, :out_features]

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        expected = step(x, ids)
        compiled(x, ids)  # compiles
        got, events = _compiled_events(compiled, x, ids)
    assert any("Torch-Compiled Region" in name for name in events)
    assert op in events and "kiln_x86_quant::dequantize" in events  # the embedding's rows
    torch.testing.assert_close(got, expected, rtol=atol, atol=atol)
