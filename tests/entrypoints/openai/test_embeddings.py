"""``kiln serve --runner pooling`` over loopback with the official ``openai`` client:
``/v1/embeddings`` (texts, token ids, batches, float and base64, ``dimensions``), vLLM's
``/pooling`` and ``/score``, the bounds on inputs, and the refusals between runners (a pooling
server refuses completions; a generate server refuses embeddings).

Expected vectors come from transformers (the GGUF dequantized by transformers, float32):
the normalised last hidden state (after the final norm) at the last prompt position, the
server's default pooling (LAST, normalize).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from kiln.testing.server import API_KEY, BASE_ARGS, KilnServer

ATOL = 1e-4
M = "kiln-embed"
"""The pooling server's ``--served-model-name``."""


@pytest.fixture(scope="module")
def pooling_server(model_path: str) -> Iterator[KilnServer]:
    kiln = KilnServer(
        [*BASE_ARGS, "--api-key", API_KEY, "--runner", "pooling", "--max-model-len", "128"]
        + ["--served-model-name", M]
    )
    yield kiln
    kiln.stop()


@pytest.fixture(scope="module")
def embed_client(pooling_server: KilnServer) -> openai.OpenAI:
    url = f"{pooling_server.url}/v1"
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def embed_http(pooling_server: KilnServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=pooling_server.url, headers=headers, timeout=120) as c:
        yield c


def _hf_last(hf_model: torch.nn.Module, ids: list[int], normalize: bool = True) -> np.ndarray:
    with torch.inference_mode():
        last = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return (torch.nn.functional.normalize(last, dim=0) if normalize else last).numpy()


def _ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_embedding_matches_transformers(embed_client, embed_http, hf_model) -> None:
    text = "The kiln fires the clay."
    response = embed_client.embeddings.create(model=M, input=text, encoding_format="float")
    ids = _ids(embed_http, text)
    (item,) = response.data
    assert item.object == "embedding" and item.index == 0 and response.object == "list"
    assert response.usage.prompt_tokens == response.usage.total_tokens == len(ids)
    got = np.array(item.embedding)
    assert got.shape == (576,)
    assert np.abs(got - _hf_last(hf_model, ids)).max() < ATOL


def test_base64_equals_float(embed_client) -> None:
    text = ["a pot", "a kiln"]
    floats = embed_client.embeddings.create(model=M, input=text, encoding_format="float")
    raw = embed_client.embeddings.create(model=M, input=text, encoding_format="base64")
    decoded = embed_client.embeddings.create(model=M, input=text)  # the SDK asks base64
    # Three requests: their rows may be computed in steps of other sizes (a prefix-cache hit,
    # another split), whose float32 GEMMs round differently (7e-7 seen); a wrong encoding (dtype,
    # byte order, element order) is off by far more than 1e-5.
    for f, b, d in zip(floats.data, raw.data, decoded.data, strict=True):
        from_b64 = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert len(from_b64) == len(f.embedding) == len(d.embedding)
        assert np.abs(from_b64 - np.array(f.embedding)).max() < 1e-5
        assert np.abs(np.array(d.embedding) - np.array(f.embedding)).max() < 1e-5


def test_input_shapes_equal_each_alone(embed_client, embed_http) -> None:
    texts = ["one", "two words", "and a longer third input of several tokens"]
    ids = [_ids(embed_http, t) for t in texts]
    alone = [embed_client.embeddings.create(model=M, input=t).data[0].embedding for t in texts]
    batched = embed_client.embeddings.create(model=M, input=texts)
    token_lists = embed_client.embeddings.create(model=M, input=ids)
    one_token_list = embed_client.embeddings.create(model=M, input=ids[2])
    assert token_lists.usage.prompt_tokens == sum(len(i) for i in ids)
    for i, want in enumerate(alone):
        for got in (batched.data[i].embedding, token_lists.data[i].embedding):
            assert np.abs(np.array(got) - want).max() < 1e-5
    assert np.abs(np.array(one_token_list.data[0].embedding) - alone[2]).max() < 1e-5


def test_dimensions_and_normalize(embed_client, embed_http, hf_model) -> None:
    text = "Matryoshka"
    ids = _ids(embed_http, text)
    raw = embed_client.embeddings.create(
        model=M, input=text, extra_body={"normalize": False}, encoding_format="float"
    )
    assert np.abs(np.array(raw.data[0].embedding) - _hf_last(hf_model, ids, False)).max() < ATOL
    cut = embed_client.embeddings.create(model=M, input=text, dimensions=32).data[0].embedding
    full = _hf_last(hf_model, ids, False)[:32]
    assert len(cut) == 32
    assert np.abs(np.array(cut) - full / np.linalg.norm(full)).max() < ATOL


def test_pooling_and_score_routes(embed_client, embed_http) -> None:
    texts = ["clay", "pottery clay", "a tax form"]
    embeddings = [
        np.array(d.embedding) for d in embed_client.embeddings.create(model=M, input=texts).data
    ]
    pooled = embed_http.post("/pooling", json={"input": texts[0]}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert np.abs(np.array(pooled["data"][0]["data"]) - embeddings[0]).max() < 1e-6
    score = embed_http.post("/score", json={"text_1": texts[0], "text_2": texts[1:]}).json()
    assert [d["object"] for d in score["data"]] == ["score", "score"]
    for item, document in zip(score["data"], embeddings[1:], strict=True):
        assert abs(item["score"] - float(embeddings[0] @ document)) < 1e-5
    pairs = embed_http.post("/v1/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
    assert abs(pairs["data"][1]["score"] - float(embeddings[1] @ embeddings[2])) < 1e-5
    for body, param in [
        ({"text_1": texts[:2], "text_2": texts}, "text_2"),
        ({"text_1": [], "text_2": texts}, "text_1"),
        ({"text_1": "a", "text_2": ["b"] * 2049}, "text_2"),
        ({"text_1": "word " * 200, "text_2": "b"}, "text_1"),
    ]:
        bad = embed_http.post("/score", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "word " * 200}, "input"),  # over --max-model-len 128
        ({"input": [[1, 2], list(range(200))]}, "input"),
        ({"input": [[1, 2], [10**9]]}, "input"),  # out of the vocabulary
        ({"input": []}, "input"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "a", "dimensions": 577}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(embed_http, body, param) -> None:
    response = embed_http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error


def test_pooling_server_refuses_completions(embed_client) -> None:
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        embed_client.completions.create(model=M, prompt="Hello", max_tokens=2)


def test_generate_server_refuses_embeddings(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=M, input="Hello")
    for path, body in [("/pooling", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"})]:
        response = http.post(path, json=body)
        assert response.status_code == 400 and "--runner pooling" in response.text


def test_pooling_routes_need_the_api_key(pooling_server: KilnServer) -> None:
    for path, body in [
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
    ]:
        response = httpx.post(f"{pooling_server.url}{path}", json=body, timeout=30)
        assert response.status_code == 401, (path, response.text)
