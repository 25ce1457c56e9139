"""Kiln's conformance kit against the x86 platform: it loads and is chosen in a fresh process,
its classes implement their interfaces, registration is idempotent, its fused ops match
``forward_native`` on every op's examples, and the default model in float32 gives the reference
cpu platform's greedy tokens exactly (the kit's exact mode: in float32 x86 keeps dense weights,
its token-for-token mode; the kept-quantized bf16 default is held to the dequantized model by
perplexity and per-layer bounds in ``test_x86_quant_methods.py``)."""

import pytest

from kiln.testing.conformance import *  # noqa: F403  (collects the kit's tests)

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module")
def kiln_platform():
    return "x86"  # the entry-point name, which is also X86Platform.name


@pytest.fixture(scope="module")
def kiln_platform_env():
    return {}  # it activates on any x86-64 machine
