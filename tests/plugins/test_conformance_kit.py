"""Kiln's conformance kit, run against the test plugin's platform as a plugin author runs it."""

import pytest

from kiln.plugin_api.conformance import *  # noqa: F403

pytestmark = pytest.mark.plugin


@pytest.fixture(scope="module")
def kiln_platform():
    return "kiln_test"


@pytest.fixture(scope="module")
def kiln_platform_env():
    return {"KILN_TEST_PLATFORM": "1", "KILN_TEST_PATCH": "good"}
