"""Fixtures of kiln-x86's tests: the default model's GGUF (installed with Kiln), and the test
process's whole core set before every test.

When these tests run after Kiln's own in one pytest process, an engine selected there (kiln-x86
on this machine) has pinned this process's threads; processes started from a pinned thread
inherit its one core, and the binding tests would see a one-core machine. The set is read when
this file is imported, at collection, before any test runs."""

import os

import pytest

from kiln.model_executor.loader.default_model import default_model_path

_INITIAL_CPUS = os.sched_getaffinity(0)


@pytest.fixture(autouse=True)
def whole_core_set() -> None:
    os.sched_setaffinity(0, _INITIAL_CPUS)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()
