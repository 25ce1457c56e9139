"""LoRA over HTTP: ``--lora-modules``, the request's ``model`` picking the adapter, ``/v1/models``
listing adapters with their ``parent``, and ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` while requests run (one server for the module, a tiny random Llama in
float32; ``--max-loras 2`` so three adapters in flight make requests wait for a slot). Chat
through the official ``openai`` client: the tiny model's 256-token vocabulary holds the default
tokenizer's single characters, so a chat template that renders the messages' text alone
(``CHAT_TEMPLATE``) gives prompts it can read."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import platform
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.testing.server import BASE_ARGS, KilnServer, stream_events

PROMPT = [1, 17, 42, 99, 7, 3, 250, 31]
MAX_TOKENS = 24
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MAX_ADAPTERS = 12
CHAT_TEXT = "!#$%"  # tokens 17, 19, 20, 21 of the default tokenizer: within the tiny vocabulary


@pytest.fixture(scope="module")
def server(tiny_base, adapters, gguf_path) -> Iterator[KilnServer]:
    args = [tiny_base, "--tokenizer", gguf_path, *BASE_ARGS, "--max-num-seqs", "8"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"a0={adapters[0].path}", "--allow-runtime-lora-updating"]
    args += ["--chat-template", CHAT_TEMPLATE, "--max-lora-adapters", str(MAX_ADAPTERS)]
    # Where detection puts it (kiln-x86 and its LoRA kernel in CI), not on the core tests' cpu;
    # the greedy texts it must give come from in-process engines (cpu).
    server = KilnServer(args, detect_platform=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def expected(tiny_base, adapters, gguf_path) -> dict[str | None, str]:
    """Greedy text of ``PROMPT`` per adapter name (None: the base), from the merged models."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts: dict[str | None, str] = {}
    for name, folder in [(None, tiny_base)] + [(a.name, a.merged) for a in adapters]:
        llm = LLM(folder, tokenizer=gguf_path, dtype="float32", kv_cache_memory=0.05)
        texts[name] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
        llm.llm_engine.shutdown()
    return texts


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return http.post("/v1/completions", json=body)


def _stream(http: httpx.Client, model: str, started: threading.Semaphore) -> tuple[int, str]:
    """A streamed ``_complete``: (status, text); releases ``started`` at its first chunk (the
    request was admitted) or at its error."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    with http.stream(
        "POST", "/v1/completions", json={**body, "ignore_eos": True, "stream": True}
    ) as r:
        if r.status_code != 200:
            started.release()
            return r.status_code, r.read().decode()
        texts = []
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not texts:
                started.release()
            texts.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
        return r.status_code, "".join(texts)


def _models(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def test_models_lists_adapters_with_their_parent(http, adapters):
    models = _models(http)
    base = next(card for card in models.values() if card["parent"] is None)
    assert models["a0"]["parent"] == base["id"]
    assert models["a0"]["root"] == adapters[0].path


def test_model_field_picks_the_adapter(http, expected):
    base_name = _base_name(http)
    for model, name in ((base_name, None), ("a0", "a0")):
        response = _complete(http, model)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[name], model
        assert response.json()["model"] == model  # the adapter's name echoed, as vLLM does


def test_chat_names_the_adapter_and_runs_it(server, http):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": CHAT_TEXT}]
    params = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    texts = {}
    for model in ("a0", _base_name(http)):
        chat = client.chat.completions.create(model=model, messages=messages, **params)
        assert chat.model == model  # the adapter's name echoed, as vLLM does
        texts[model] = chat.choices[0].message.content
        # The chat prompt is the text alone: the completion of that text, adapter and all.
        completion = client.completions.create(model=model, prompt=CHAT_TEXT, **params)
        assert texts[model] == completion.choices[0].text, model
    assert texts["a0"] != texts[_base_name(http)]
    stream = client.chat.completions.create(model="a0", messages=messages, stream=True, **params)
    chunks = list(stream)
    assert len(chunks) > 2 and {chunk.model for chunk in chunks} == {"a0"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts["a0"]


def test_stream_chunks_name_the_adapter(http):
    body = {"model": "a0", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    chunks = stream_events(http, "/v1/completions", body)
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
    assert {chunk["model"] for chunk in chunks[:-1]} == {"a0"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_adapter_is_a_404(http, path):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    body = {
        "model": "no-such-adapter",
        "max_tokens": 1,
        **(chat if "chat" in path else {"prompt": "hi"}),
    }
    response = http.post(path, json=body)
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_served_on_the_default_platform_with_its_lora_kernel(http):
    """No ``--platform``: the server runs where detection puts it, x86 on an x86-64 machine
    with kiln-x86 installed (as in CI), where ``lora_apply`` has the plugin's kernel."""
    report = http.get("/debug/plugins").json()
    x86 = importlib.util.find_spec("kiln_x86") is not None and platform.machine() == "x86_64"
    assert report["platform"]["name"] == ("x86" if x86 else "cpu")
    providers = {i["provider"] for i in report["op_implementations"] if i["op"] == "lora_apply"}
    assert ("kiln_x86" in providers) == x86


def _base_name(http: httpx.Client) -> str:
    return next(card["id"] for card in _models(http).values() if card["parent"] is None)


def test_load_and_unload_while_requests_run(http, adapters, expected):
    base_name = _base_name(http)
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_stream, http, "a0", started) for _ in range(3)]
        for _ in running:  # each admitted (its first chunk came) before a0 is unloaded
            assert started.acquire(timeout=120)
        for adapter in adapters[1:]:
            body = {"lora_name": adapter.name, "lora_path": adapter.path}
            response = http.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 200, response.text
        # Three adapters and the base model in flight, two adapter slots.
        more = [
            (name, pool.submit(_complete, http, model))
            for name, model in (("a1", "a1"), ("a2", "a2"), (None, base_name), ("a1", "a1"))
        ]
        response = http.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})
        assert response.status_code == 200, response.text
        for future in running:  # admitted before the unload: they finish with a0
            status, text = future.result()
            assert status == 200, text
            assert text == expected["a0"]
        for name, future in more:
            result = future.result()
            assert result.status_code == 200, result.text
            assert result.json()["choices"][0]["text"] == expected[name], name
    assert _complete(http, "a0").status_code == 404
    assert "a0" not in _models(http) and {"a1", "a2"} <= set(_models(http))
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "a0"})
    assert response.status_code == 404


@pytest.mark.parametrize(
    "change, match",
    [
        ({"r": 16}, "max_lora_rank"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ],
)
def test_bad_adapters_are_refused_at_load(http, adapters, tmp_path, change, match):
    folder = tmp_path / "bad"
    shutil.copytree(adapters[1].path, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    body = {"lora_name": "bad", "lora_path": str(folder)}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400
    assert match in response.json()["error"]["message"]
    assert "bad" not in _models(http)


HEADER_OF_2_62_BYTES = (2**62).to_bytes(8, "little") + b"{}"


@pytest.mark.parametrize(
    "file, content, match",
    [
        ("adapter_config.json", b"[1]", "holds a JSON list"),
        ("adapter_config.json", b'{"r": 8, "lora_alpha": [1]}', "lora_alpha"),
        ("adapter_config.json", b'{"r": 8, "target_modules": 5}', "target_modules"),
        ("adapter_config.json", b'{"r": true}', "r=True"),
        ("adapter_model.safetensors", HEADER_OF_2_62_BYTES, "cannot be read"),
    ],
)
def test_malformed_adapter_files_are_400s(http, adapters, tmp_path, file, content, match):
    folder = tmp_path / "malformed"
    shutil.copytree(adapters[1].path, folder)
    (folder / file).write_bytes(content)
    body = {"lora_name": "malformed", "lora_path": str(folder)}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]
    assert "malformed" not in _models(http)


def test_loaded_adapters_are_capped(http, adapters):
    """Names up to --max-lora-adapters load; the next is a 400 until one is unloaded."""
    loaded = []
    try:
        for index in range(MAX_ADAPTERS + 1):
            name = f"many-{index}"
            body = {"lora_name": name, "lora_path": adapters[1].path}
            response = http.post("/v1/load_lora_adapter", json=body)
            if response.status_code != 200:
                break
            loaded.append(name)
        assert response.status_code == 400, "every load was accepted"
        assert "--max-lora-adapters" in response.json()["error"]["message"]
        assert len(_models(http)) == 1 + MAX_ADAPTERS  # the base model and the adapters
    finally:
        for name in loaded:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    body = {"lora_name": "after-unload", "lora_path": adapters[1].path}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
    http.post("/v1/unload_lora_adapter", json={"lora_name": "after-unload"})


def test_a_name_in_use_is_refused(http, adapters):
    body = {"lora_name": "twice", "lora_path": adapters[1].path}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
    for name in (_base_name(http), "twice"):
        response = http.post("/v1/load_lora_adapter", json={**body, "lora_name": name})
        assert response.status_code == 400, name
        assert "already been loaded" in response.json()["error"]["message"]


def _load_copy(http: httpx.Client, adapter, folder: pathlib.Path, name: str) -> pathlib.Path:
    """Load a copy of ``adapter``'s folder as ``name``; returns its weights file."""
    shutil.copytree(adapter.path, folder)
    response = http.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}
    )
    assert response.status_code == 200, response.text
    return folder / "adapter_model.safetensors"


def _assert_request_error(error: dict, folder: pathlib.Path) -> None:
    """An OpenAI error body that names the adapter and carries no path or traceback."""
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == 400 and error["type"] == "BadRequestError", error
    assert "'victim" in error["message"], error
    assert str(folder) not in error["message"] and "Traceback" not in error["message"], error


def _assert_still_serving(server, http: httpx.Client, expected) -> None:
    assert http.get("/health").status_code == 200
    response = _complete(http, _base_name(http))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected[None]
    assert server.proc.poll() is None


def test_an_adapter_whose_files_were_removed_fails_only_its_requests(
    server, http, adapters, expected, tmp_path
):
    folder = tmp_path / "victim"
    weights = _load_copy(http, adapters[1], folder, "victim")
    assert _complete(http, "victim").json()["choices"][0]["text"] == expected["a1"]
    weights.unlink()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="victim", prompt=PROMPT, max_tokens=4, stream=stream)
        _assert_request_error(refused.value.body, folder)
        assert refused.value.body["param"] == "model"
    _assert_still_serving(server, http, expected)


def test_adapter_files_that_fail_in_the_worker_fail_only_their_requests(
    server, http, adapters, expected, tmp_path
):
    """The weights file is corrupted in place with its size and mtime kept, so the front end's
    check (cached by them) lets the requests through and the worker's load fails: the request
    gets a 400 (a stream: an error event), and the engine goes on."""
    weights = _load_copy(http, adapters[2], tmp_path / "victim", "victim-late")
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 8)  # the header's length: far past the end of the file
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    body = {"model": "victim-late", "prompt": PROMPT, "max_tokens": 4}
    events = stream_events(http, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    _assert_request_error(events[-2]["error"], tmp_path)
    response = http.post("/v1/completions", json=body)
    _assert_request_error(response.json()["error"], tmp_path)
    assert response.status_code == 400
    _assert_still_serving(server, http, expected)
