"""Kiln's conformance kit against the built-in cpu platform: the reference passes its own kit."""

import pytest

from kiln.testing.conformance import *  # noqa: F403

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module")
def kiln_platform():
    return "cpu"


@pytest.fixture(scope="module")
def kiln_platform_env():
    return {}
