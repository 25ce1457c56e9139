"""Kiln's conformance kit against the x86 platform: it loads and is chosen in a fresh process,
its classes implement their interfaces, registration is idempotent, its fused ops match
``forward_native`` on every op's examples, and the default model's greedy float32 tokens equal
those of Kiln's reference cpu platform."""

import pytest

from kiln.testing.conformance import *  # noqa: F403  (collects the kit's tests)

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module")
def kiln_platform():
    return "x86"  # the entry-point name, which is also X86Platform.name


@pytest.fixture(scope="module")
def kiln_platform_env():
    return {}  # it activates on any x86-64 machine
