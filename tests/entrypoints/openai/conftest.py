"""Fixtures of the server tests: ``server`` (package-scoped) is a real ``kiln serve`` of the
default model with a small KV cache and an API key, started once for every module that uses it
and always stopped at teardown; ``client`` (the official ``openai`` client) and ``http`` (httpx)
talk to it. The lifecycle tests start servers of their own, since they stop them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer


@pytest.fixture(scope="package")
def model_path(gguf_path: str) -> str:
    """The default model; missing, it fails the tests (see the root conftest), never skips."""
    return gguf_path


@pytest.fixture(scope="package")
def server(model_path: str) -> Iterator[KilnServer]:
    """The shared server: default model, API key ``API_KEY``, up to 8 requests per step."""
    kiln = KilnServer([*BASE_ARGS, "--api-key", API_KEY, "--max-num-seqs", "8"])
    yield kiln
    kiln.stop()


@pytest.fixture(scope="package")
def client(server: KilnServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def http(server: KilnServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
