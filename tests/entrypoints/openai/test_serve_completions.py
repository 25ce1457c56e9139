"""``POST /v1/completions`` against a real server: shapes, fields, streaming, echo + logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest

from kiln.testing.server import parse_sse, stream_events

PROMPT = "The capital of France is"


def _tokenize(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_completion_response_shape(http: httpx.Client, model_name: str) -> None:
    response = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    )
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == model_name
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(_tokenize(http, PROMPT))
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPT,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 16


def test_stream_matches_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None


def test_sse_framing_and_usage_chunk(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    events = stream_events(http, "/v1/completions", body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert all("usage" not in e for e in events[:-1])  # no include_usage: no usage anywhere
    with_usage = stream_events(
        http, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    *chunks, last, done = with_usage
    assert done == "[DONE]"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 6
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert {c["id"] for c in with_usage[:-1]} == {last["id"]}
    continuous = stream_events(
        http,
        "/v1/completions",
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    counts = [c["usage"]["completion_tokens"] for c in continuous[:-2]]
    assert counts == sorted(counts) and counts[-1] == 6


def test_n_completions(client: openai.OpenAI, model_name: str) -> None:
    kwargs = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 10, "n": 3}
    extra = {"extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs, temperature=1.0, seed=7, **extra)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert len({c.text for c in full.choices}) >= 2  # seeds differ per completion
    assert full.usage is not None and full.usage.completion_tokens == 3 * 10
    chunks = list(
        client.completions.create(**kwargs, temperature=1.0, seed=7, stream=True, **extra)
    )
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks]
    finished = sorted(i for i, reason in finishes if reason)
    assert finished == [0, 1, 2]
    texts = {i: "" for i in range(3)}
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {c.index: c.text for c in full.choices}  # same seed, same completions


def test_batched_prompts_text_and_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = _tokenize(http, PROMPT)
    completion = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=[PROMPT, "Hello", PROMPT],
        max_tokens=5,
        temperature=0,
    )
    by_index = {c.index: c.text for c in completion.choices}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0] == by_index[2]
    from_ids = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=[ids, ids],
        max_tokens=5,
        temperature=0,
    )
    assert [c.text for c in sorted(from_ids.choices, key=lambda c: c.index)] == [by_index[0]] * 2
    assert from_ids.usage is not None and from_ids.usage.prompt_tokens == 2 * len(ids)


def test_echo_logprobs_on_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    """What lm-eval's loglikelihood does: token ids in, echo + logprobs, first entry null."""
    ids = _tokenize(http, PROMPT)
    plain = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=ids,
        max_tokens=1,
        temperature=0,
        logprobs=1,
    )
    echoed = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=ids,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
    )
    choice = echoed.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(ids) + 1  # exactly the ids given (no BOS) + 1 generated
    assert (
        lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    )
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert choice.text == PROMPT + plain.choices[0].text
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0])
    for top in lp.top_logprobs[1:]:
        assert 1 <= len(top) <= 2
    # max_tokens=0 with echo: the prompt only.
    only = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=ids,
        max_tokens=0,
        echo=True,
        logprobs=0,
    )
    assert only.choices[0].text == PROMPT
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert only.usage is not None and only.usage.completion_tokens == 0


def test_echo_stream_starts_with_prompt(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}
    events = stream_events(http, "/v1/completions", body)
    assert events[0]["choices"][0]["text"].startswith(PROMPT)


@pytest.mark.parametrize(("num_logprobs", "sizes"), [(0, {1}), (5, {5, 6})])
def test_logprobs_sizes(client: openai.OpenAI, num_logprobs: int, sizes: set[int]) -> None:
    completion = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=num_logprobs,
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == completion.choices[0].text
    assert {len(top) for top in lp.top_logprobs} <= sizes
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is top


def test_stop_string_and_stop_reason(client: openai.OpenAI) -> None:
    kwargs = {"model": None, "prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 16}
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert " 7" in full
    stopped = client.completions.create(**kwargs, stop=[" 7"]).choices[0]  # type: ignore[call-overload]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(" 7")]
    assert stopped.model_extra is not None and stopped.model_extra["stop_reason"] == " 7"
    kept = client.completions.create(  # type: ignore[call-overload]
        **kwargs, stop=" 7", extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == full[: full.index(" 7") + 2]


def test_vllm_extra_fields(http: httpx.Client) -> None:
    def complete(**fields: object) -> dict:
        body = {"prompt": PROMPT, "temperature": 0, "return_token_ids": True, **fields}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    tokens = complete(max_tokens=6)["token_ids"]
    # stop_token_ids: stops at (and includes) that token; stop_reason is the id.
    stopped = complete(max_tokens=6, stop_token_ids=[tokens[2]])
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == tokens[2]
    assert stopped["token_ids"][-1] == tokens[2]
    # logit_bias +100 on one token makes greedy decoding pick it every time.
    forced = complete(max_tokens=3, ignore_eos=True, logit_bias={str(tokens[0] + 1): 100})
    assert forced["token_ids"] == [tokens[0] + 1] * 3
    # min_tokens with ignore_eos: exactly max_tokens.
    # Every other field is accepted (with sensible values the output stays deterministic).
    body = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "min_tokens": 4,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "seed": 1234,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": True,
        "user": "tester",
        "stop": None,
        "not_a_field": {"benchmark": "clients send these"},
    }
    first = http.post("/v1/completions", json=body).json()
    second = http.post("/v1/completions", json=body).json()
    assert first["usage"]["completion_tokens"] == 4
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # same seed


def test_prompt_logprobs_extra(http: httpx.Client) -> None:
    ids = _tokenize(http, PROMPT)
    choice = http.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "return_token_ids": True},
    ).json()["choices"][0]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, position in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in position and len(position) <= 3
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 1


def test_stream_raw_lines(http: httpx.Client) -> None:
    """The exact bytes: ``data: {...}\\n\\n`` events, ``data: [DONE]\\n\\n`` at the end."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.split("\n\n") if block)
    parse_sse(raw.split("\n")[:-1])
