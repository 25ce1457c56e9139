"""The other routes, errors, the API key and /metrics, against a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from kiln.testing import plugin_report
from kiln.testing.server import API_KEY, MAX_MODEL_LEN, KilnServer, metric, scrape


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    (model,) = client.models.list().data
    assert model.object == "model" and model.owned_by == "kiln"
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert body["data"][0]["root"].endswith(".gguf")


def test_health_version_plugins(server: KilnServer) -> None:
    # No API key needed outside /v1.
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    report = httpx.get(f"{server.url}/debug/plugins").json()
    # The platform this machine selects (cpu, or an installed plugin such as kiln-x86), as a
    # fresh `kiln plugins` sees it, reported by the engine core, where the platform acts: its
    # worker phase ran there; the API server's own view is attached.
    _rc, fresh = plugin_report()
    assert report["platform"]["name"] == fresh["platform"]["name"] and report["role"] == "engine"
    assert report["phases"][-1] == "init-worker", report["phases"]
    assert report["api_process"]["role"] == "api"
    assert report["api_process"]["pid"] != report["pid"]
    assert all(c["status"] == "ok" for c in report["classes"]), report["classes"]


def test_tokenize_detokenize(http: httpx.Client) -> None:
    text = "Hello world, hello Kiln!"
    tokenized = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert len(tokenized["token_strs"]) == tokenized["count"]
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > tokenized["count"]  # the template adds role markers
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_api_key(server: KilnServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == 401 and error["type"] == "AuthenticationError"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


LONG_PROMPT = "hello " * 1100


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": ""}, "non-empty"),
        ({"prompt": []}, "non-empty"),
        ({"prompt": [[]]}, "non-empty"),
        ({"prompt": None}, "non-empty"),
        ({"prompt": [1, -1]}, "greater than or equal to 0"),
        ({"prompt": [1, 10**7]}, "out of vocabulary"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream=True"),
        ({"prompt": "x", "logprobs": 21}, "max_logprobs"),
        ({"prompt": "x", "logprobs": 21, "stream": True}, "max_logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2000}, "is too large: 2000"),
        ({"prompt": "x", "max_tokens": 2000, "stream": True}, "is too large: 2000"),
        ({"prompt": LONG_PROMPT}, "maximum context length is 1024 tokens"),
        ({"prompt": LONG_PROMPT, "stream": True}, "maximum context length is 1024 tokens"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, "49152"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "n": 0}, "n must be"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_bad_completion_requests_are_400(http: httpx.Client, body: dict, needle: str) -> None:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert needle in error["message"]


def test_malformed_bodies_are_400(http: httpx.Client) -> None:
    for content, content_type in [
        (b"[1, 2]", "application/json"),
        (b"not json", "application/json"),
        (b'{"prompt": "x"', "application/json"),
        (b"prompt=x", "application/x-www-form-urlencoded"),
    ]:
        response = http.post(
            "/v1/completions", content=content, headers={"Content-Type": content_type}
        )
        assert response.status_code == 400, (content, response.text)
        assert response.json()["error"]["code"] == 400


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "The model `no-such-model` does not exist." in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )


def test_lora_adapter_routes_need_their_flag(http: httpx.Client) -> None:
    """As vLLM: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist only with
    ``--allow-runtime-lora-updating`` (this server has neither it nor ``--enable-lora``)."""
    body = {"lora_name": "x", "lora_path": "/nonexistent"}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404


def test_server_keeps_serving_after_errors(client: openai.OpenAI) -> None:
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=None, prompt="x", logprobs=99)  # type: ignore[arg-type]
    completion = client.completions.create(model=None, prompt="x", max_tokens=2)  # type: ignore[arg-type]
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_metrics_count_known_requests(http: httpx.Client, model_name: str) -> None:
    before = scrape(http)
    labels = {"model_name": model_name, "engine": "0"}
    prompts = ["One", "Two three", "Four five six"]
    num_prompt = 0
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        num_prompt += http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    after = scrape(http)

    def delta(name: str, **extra: str) -> float:
        return metric(after, name, **labels, **extra) - metric(before, name, **labels, **extra)

    assert delta("vllm:prompt_tokens_total") == num_prompt
    assert delta("vllm:generation_tokens_total") == 3 * 4
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3
    assert delta("vllm:prefix_cache_queries_total") >= num_prompt - 3
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric(after, name, **labels) == 0
    assert metric(after, "vllm:num_preemptions_total", **labels) == 0
    assert metric(after, "vllm:request_success_total", finished_reason="abort") >= 0
    assert metric(after, "vllm:kv_cache_usage_perc", **labels) == 0


def test_metrics_is_prometheus_text(server: KilnServer) -> None:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in response.text
    assert "# TYPE vllm:prompt_tokens_total counter" in response.text
    assert "_created" not in response.text


CONTEXT_1024 = "This model's maximum context length is 1024 tokens"
OUT_OF_VOCAB = "token id 50000 at position 1 of {} is out of vocabulary (vocab_size=49152)"


@pytest.mark.parametrize(
    ("route", "body", "param", "message"),
    [
        # The third prompt of a batch is named by its index.
        (
            "completions",
            {"prompt": [[1], [2], [1, 50000]]},
            "prompt",
            OUT_OF_VOCAB.format("prompt 2"),
        ),
        (
            "completions",
            {"prompt": [3, -1]},
            "prompt",
            "token id -1 at position 1 of prompt 0 must be greater than or equal to 0",
        ),
        (
            "completions",
            {"prompt": [1] * 1024},
            "prompt",
            f"{CONTEXT_1024}. However, your request has 1024 input tokens. Please reduce the "
            "length of the input messages.",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1020},
            "max_tokens",
            "'max_tokens' or 'max_completion_tokens' is too large: 1020. This model's maximum "
            "context length is 1024 tokens and your request has {n} input tokens (1020 > 1024 - "
            "{n}).",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi " * 1030}]},
            "messages",
            None,
        ),
        ("detokenize", {"tokens": [5, 50000]}, "tokens", OUT_OF_VOCAB.format("tokens")),
    ],
)
def test_admission_errors_keep_their_message_and_param(
    http: httpx.Client, route: str, body: dict, param: str, message: str | None
) -> None:
    response = http.post(f"/v1/{route}" if route != "detokenize" else "/detokenize", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if message is None:
        assert error["message"].startswith(CONTEXT_1024)
    elif "{n}" in message:
        tokenized = http.post("/tokenize", json={"messages": body["messages"]}).json()
        assert error["message"] == message.format(n=tokenized["count"])
    else:
        assert error["message"] == message


def test_openapi_lists_the_statuses_the_server_answers(http: httpx.Client) -> None:
    """400 with an OpenAI error body where FastAPI would document 422, which Kiln never sends."""
    document = http.get("/openapi.json").json()
    statuses = {
        (method, path): set(operation["responses"])
        for path, item in document["paths"].items()
        for method, operation in item.items()
    }
    assert not [key for key, codes in statuses.items() if "422" in codes]
    assert statuses[("post", "/v1/completions")] == {
        "200",
        "400",
        "401",
        "404",
        "413",
        "500",
        "503",
    }
    assert statuses[("get", "/v1/models")] == {"200", "401", "500"}
    assert statuses[("get", "/health")] == {"200", "500", "503"}
    error = document["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    ref = error["content"]["application/json"]["schema"]["$ref"]
    assert document["components"]["schemas"][ref.rsplit("/", 1)[-1]]["required"] == ["error"]
