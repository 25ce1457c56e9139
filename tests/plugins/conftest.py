"""The plugin tests exercise selection with the test plugin's platforms, which must be the only
out-of-tree candidates: an installed platform plugin that activates on this machine (kiln-x86 on
x86-64) would make every "one out-of-tree platform activates" case a two-platform error. Its
documented opt-out, ``KILN_X86=0``, keeps it inactive here; the fresh processes the tests start
inherit it. kiln-x86's own tests check its selection. Selection is what these tests test, so they
run without the core tests' ``KILN_PLATFORM=cpu`` (tests/conftest.py); a test that forces a
platform names it."""

import pytest


@pytest.fixture(autouse=True)
def only_the_test_plugins_platforms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_X86", "0")
    monkeypatch.delenv("KILN_PLATFORM", raising=False)
