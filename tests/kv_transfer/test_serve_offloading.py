"""``kiln serve --kv-offloading-size`` end to end: the official openai client sends A, B, A
(prompts that evict each other from a paged cache of about 11 blocks); the second A's prefix
comes back from the CPU tier, it gets the first A's answer, and ``/metrics`` counts what the
connector supplied and moved."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kiln.testing.checks import CONNECTOR_KV_GIB, CONNECTOR_PROMPTS
from kiln.testing.server import KilnServer, metric, scrape

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[KilnServer]:
    args = ["--dtype", "float32", "--kv-cache-memory", str(CONNECTOR_KV_GIB)]
    args += ["--max-model-len", "160", "--kv-offloading-size", "0.25", "--disable-log-stats"]
    kiln = KilnServer(args)
    yield kiln
    kiln.stop()


def test_a_prefix_evicted_from_the_paged_cache_comes_back_from_the_cpu_tier(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    answers = []
    for prompt in (CONNECTOR_PROMPTS[0], CONNECTOR_PROMPTS[1], CONNECTOR_PROMPTS[0]):
        answers.append(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1
            )
        )
    first, _, again = answers
    assert again.choices[0].text == first.choices[0].text
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(
        first.choices[0].logprobs.token_logprobs, abs=1e-4
    )
    with httpx.Client(base_url=server.url) as http:
        samples = scrape(http)
    supplied = metric(samples, "vllm:external_prefix_cache_hits_total")
    local = metric(samples, "vllm:prefix_cache_hits_total")
    assert supplied >= 64 and supplied % 16 == 0, (supplied, local)
    assert metric(samples, "vllm:kv_connector_loaded_blocks_total") == supplied // 16
    assert metric(samples, "vllm:kv_connector_saved_blocks_total") >= 12
    assert metric(samples, "vllm:kv_connector_saved_bytes_total") > 0
    assert metric(samples, "vllm:kv_connector_failed_loads_total") == 0
