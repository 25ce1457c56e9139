"""``kiln serve --speculative-config`` with a draft model, end to end: the official ``openai``
client over loopback gets the greedy text of no speculation (completions and chat, several
requests at once), and ``/metrics`` and the periodic stats line report the drafts; with two
data-parallel engines, each drafting, too. The target and the draft are tiny random models with
the default model's tokenizer (see ``spec_utils``); the reference is the target served offline
without speculation, on the same platform."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from spec_utils import save_tiny_repeater

from kiln import LLM, SamplingParams
from kiln.testing.server import KilnServer, metric, scrape

pytestmark = pytest.mark.slow

K = 3
MAX_TOKENS = 32
PROMPTS = [
    "def add(a, b):\n    total = a + b\n    return total\n",
    "red, green, blue, red, green, blue, red,",
    "The capital of France is",
]
CHAT = [{"role": "user", "content": "Copy this: one two three one two three"}]
ARGS = ["--dtype", "float32", "--kv-cache-memory", "0.05", "--max-model-len", "256"]
ARGS += ["--uvicorn-log-level", "warning"]


@pytest.fixture(scope="module")
def target(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_repeater(tmp_path_factory.mktemp("target"), gguf_path)


@pytest.fixture(scope="module")
def draft(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Another random model, smaller: it agrees with the target on some tokens, not all.
    return save_tiny_repeater(
        tmp_path_factory.mktemp("draft"), gguf_path, seed=1, num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def server(target: str, draft: str):
    config = json.dumps({"model": draft, "num_speculative_tokens": K})
    # Stats logging stays on (no --disable-log-stats): the stats line is checked in the log.
    kiln = KilnServer([target, *ARGS, "--speculative-config", config, "--max-num-seqs", "4"])
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def client(server: KilnServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: KilnServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def plain(target: str) -> LLM:
    return LLM(target, dtype="float32", kv_cache_memory=0.05, max_model_len=256)


def _complete(client: openai.OpenAI, prompt: str) -> str:
    model = client.models.list().data[0].id
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].text


def test_greedy_text_is_that_of_no_speculation(client: openai.OpenAI, plain: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in one batch, as far as they overlap
        got = list(pool.map(lambda prompt: _complete(client, prompt), PROMPTS))
    assert got == expected
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert (
        chat.choices[0].message.content
        == plain.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    )


def test_metrics_and_the_stats_line_report_the_drafts(
    server: KilnServer, client: openai.OpenAI, http: httpx.Client
) -> None:
    _complete(client, PROMPTS[0])
    samples = scrape(http)
    drafts = metric(samples, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted < draft_tokens <= K * drafts, samples
    rate = metric(samples, "vllm:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / draft_tokens)
    # Tokens per verifying step: the accepted drafts and one more token each.
    length = metric(samples, "vllm:spec_decode_mean_accepted_length")
    assert length == pytest.approx(1 + accepted / drafts)
    # The stats line comes at most every 10 s while the engine works: keep it working.
    deadline = time.monotonic() + 60
    while "spec decode: acceptance rate" not in server.output() and time.monotonic() < deadline:
        _complete(client, PROMPTS[1])
    line = next(
        (line for line in server.output().splitlines() if "spec decode: acceptance rate" in line),
        None,
    )
    assert line is not None, server.output()[-3000:]
    assert "mean accepted length" in line


def test_data_parallel_engines_each_speculate_with_their_own_draft(
    target: str, draft: str, plain: LLM
) -> None:
    """``-dp 2``: each engine core loads its own draft and its draft cache (in its half of the
    KV budget); requests on either engine get the greedy text of no speculation."""
    config = json.dumps({"model": draft, "num_speculative_tokens": K})
    kiln = KilnServer(
        [target, *ARGS, "--speculative-config", config, "--data-parallel-size", "2"],
        start_timeout=600,
    )
    try:
        client = openai.OpenAI(base_url=f"{kiln.url}/v1", api_key="none", max_retries=0)
        prompts = PROMPTS * 2
        # At once: the least busy engine takes each, so both engines get some.
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda prompt: _complete(client, prompt), prompts))
        with httpx.Client(base_url=kiln.url, timeout=120) as http:
            samples = scrape(http)
    finally:
        kiln.stop()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    for engine in ("0", "1"):
        drafts = metric(samples, "vllm:spec_decode_num_drafts_total", engine=engine)
        accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total", engine=engine)
        assert drafts > 0 and accepted > 0, (engine, samples)
