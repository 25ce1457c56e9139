"""The pooling routes (``--runner pooling``): ``POST /v1/embeddings`` (OpenAI's), and vLLM's
``POST /pooling`` and ``POST /score`` (also at ``/v1/score``, as vLLM serves it).

Responses::

    /v1/embeddings: {"id": "embd-...", "object": "list", "created", "model",
                     "data": [{"object": "embedding", "index", "embedding"}, ...],
                     "usage": {"prompt_tokens", "total_tokens"}}
    /pooling:       the same with "id": "pool-...", items {"object": "pooling", "index", "data"}
    /score:         {"id": "score-...", "object": "list", "created", "model",
                     "data": [{"object": "score", "index", "score"}, ...],
                     "usage": {"prompt_tokens", "completion_tokens": 0, "total_tokens"}}

A vector is a list of numbers (``encoding_format: "float"``) or, with ``"base64"``, the base64 of
its float32 little-endian bytes (as OpenAI's). ``dimensions`` keeps a vector's first values and
then normalises; ``normalize`` (vLLM's) overrides the server's ``--pooler-config``. A score is the
cosine similarity of two embeddings (vLLM's score for an embedding model): ``text_1`` (one
text) against each of ``text_2``, or the two lists pair by pair.

Each input is checked by the engine's input processor (its length, its token ids: a 400 naming
``input``, or ``text_1`` / ``text_2``) before anything runs; a request holds at most
``MAX_INPUTS`` inputs. A server that is not a pooling one answers these routes with a 400 saying
to serve the model with ``--runner pooling``; a pooling server refuses completions and chat in
its input processor, with the converse message.

What it must not know: the engine's internals (it talks to ``AsyncLLM``).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from kiln.engine.frontend import pooling_sampling_params
from kiln.engine.input_processor import PromptError
from kiln.entrypoints.openai.errors import OpenAIError, bad_request
from kiln.entrypoints.openai.protocol_pooling import MAX_INPUTS, EmbeddingRequest, ScoreRequest
from kiln.entrypoints.openai.serving_engine import OpenAIServing, Prompt, ServerState, usage
from kiln.messages import EngineCoreRequest
from kiln.pooling_params import PoolingParams

POOLING_PATHS = ("/v1/embeddings", "/pooling", "/score", "/v1/score")
"""The routes ``register_pooling_routes`` adds."""


class OpenAIServingPooling(OpenAIServing):
    request_fields = frozenset(EmbeddingRequest.model_fields) | frozenset(ScoreRequest.model_fields)

    @property
    def _prompt_param(self) -> str:
        return "input"

    async def embeddings(self, request: EmbeddingRequest, raw: Request, kind: str) -> Response:
        """``/v1/embeddings`` (``kind="embedding"``) or ``/pooling`` (``kind="pooling"``)."""
        self._check_request(request.model)
        self.note_unknown_fields(request)
        items = _input_items(request.input)
        try:
            pooling_params = PoolingParams(request.dimensions, request.normalize)
        except ValueError as exc:
            raise bad_request(exc, self.request_fields) from None
        prompts = [
            await self._tokenize(item, request.add_special_tokens, "input") for item in items
        ]
        request_id = self.make_request_id("embd" if kind == "embedding" else "pool", request, raw)
        engine_requests = self._process(
            request_id, prompts, ["input"] * len(prompts), pooling_params, request
        )
        key = "embedding" if kind == "embedding" else "data"
        encode = _base64 if request.encoding_format == "base64" else _floats

        async def work() -> dict[str, Any]:
            vectors = await self._collect(engine_requests)
            data = [
                {"object": kind, "index": i, key: encode(vector)}
                for i, vector in enumerate(vectors)
            ]
            num_tokens = sum(len(r.prompt_token_ids) for r in engine_requests)
            return self._body(
                request_id, data, {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
            )

        return await self.respond(raw, [r.request_id for r in engine_requests], work())

    async def score(self, request: ScoreRequest, raw: Request) -> Response:
        """``/score``: cosine similarities of normalised embeddings."""
        self._check_request(request.model)
        self.note_unknown_fields(request)
        queries = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        documents = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        for name, texts in (("text_1", queries), ("text_2", documents)):
            if not 1 <= len(texts) <= MAX_INPUTS:
                raise OpenAIError(
                    f"{name} must hold 1 to {MAX_INPUTS} texts, got {len(texts)}", param=name
                )
        if len(queries) != 1 and len(queries) != len(documents):
            raise OpenAIError(
                f"text_2 must hold as many texts as text_1 ({len(queries)}) or text_1 one "
                f"text, got {len(documents)}",
                param="text_2",
            )
        names = ["text_1"] * len(queries) + ["text_2"] * len(documents)
        texts = [*queries, *documents]
        prompts = [
            await self._tokenize(text, request.add_special_tokens, name)
            for text, name in zip(texts, names, strict=True)
        ]
        request_id = self.make_request_id("score", request, raw)
        engine_requests = self._process(
            request_id, prompts, names, PoolingParams(normalize=True), request
        )

        async def work() -> dict[str, Any]:
            vectors = [np.frombuffer(v, dtype="<f4") for v in await self._collect(engine_requests)]
            query_vectors, document_vectors = vectors[: len(queries)], vectors[len(queries) :]
            if len(query_vectors) == 1:
                query_vectors = query_vectors * len(document_vectors)
            data = [
                {"object": "score", "index": i, "score": float(np.dot(q, d))}
                for i, (q, d) in enumerate(zip(query_vectors, document_vectors, strict=True))
            ]
            num_tokens = sum(len(r.prompt_token_ids) for r in engine_requests)
            return self._body(request_id, data, usage(num_tokens, 0))

        return await self.respond(raw, [r.request_id for r in engine_requests], work())

    # -- shared ---------------------------------------------------------------------------------

    def _check_request(self, model: str | None) -> None:
        """Raises a 400 unless this is a pooling server and ``model`` the served model (404
        for an unknown one; adapters are not served here)."""
        if self.frontend.input_processor.runner != "pooling":
            raise OpenAIError(
                "this server does not serve embeddings: its model runs --runner generate; "
                "serve the model with --runner pooling for /v1/embeddings, /pooling and /score"
            )
        if self.check_model(model) is not None:
            raise OpenAIError("LoRA adapters are not served by the pooling routes", param="model")
        self.check_ready()

    async def _tokenize(self, item: str | list[int], add_special_tokens: bool, name: str) -> Prompt:
        if isinstance(item, list):
            return Prompt(item)
        try:
            self.check_text_length(item)
        except OpenAIError as exc:
            exc.param = name
            raise
        return Prompt(await self.encode(item, add_special_tokens) if item else [], item)

    def _process(
        self,
        request_id: str,
        prompts: list[Prompt],
        names: list[str],
        pooling_params: PoolingParams,
        request: EmbeddingRequest | ScoreRequest,
    ) -> list[EngineCoreRequest]:
        """Each input through the input processor (a 400 naming its field when refused)."""
        try:
            params = pooling_sampling_params(request.truncate_prompt_tokens)
        except ValueError as exc:
            raise bad_request(exc, self.request_fields) from None
        base = f"{request_id}-{uuid.uuid4().hex[:8]}"
        process = self.frontend.input_processor.process
        requests = []
        for index, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            try:
                requests.append(
                    process(
                        f"{base}-{index}",
                        prompt.for_engine(),
                        params,
                        None,
                        request.priority,
                        prompt_name=f"{name} {index}",
                        pooling_params=pooling_params,
                    )
                )
            except ValueError as exc:
                error = bad_request(exc, self.request_fields)
                if isinstance(exc, PromptError) and exc.param == "prompt":
                    error.param = name
                raise error from None
        return requests

    async def _collect(self, requests: list[EngineCoreRequest]) -> list[bytes]:
        """Run the requests; their vectors (float32 little-endian bytes), in order."""
        _, outputs = self.generate(requests)
        vectors: list[bytes] = [b""] * len(requests)
        async for index, output in outputs:
            if output.finished and output.pooled is not None:
                vectors[index] = output.pooled
        return vectors

    def _body(self, request_id: str, data: list[dict[str, Any]], counts: dict[str, int]) -> dict:
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.state.model_name,
            "data": data,
            "usage": counts,
        }


def _input_items(value: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The inputs of ``input``: a text or token ids is one input."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError("input must hold at least one input", param="input")
    if all(isinstance(x, int) for x in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise OpenAIError(
            f"input must hold at most {MAX_INPUTS} inputs, got {len(value)}", param="input"
        )
    return list(value)


def _floats(vector: bytes) -> list[float]:
    return np.frombuffer(vector, dtype="<f4").tolist()


def _base64(vector: bytes) -> str:
    return base64.b64encode(vector).decode("ascii")


def register_pooling_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``POOLING_PATHS`` to ``app``."""
    pooling = OpenAIServingPooling(state)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await pooling.embeddings(request, raw, "embedding")

    @app.post("/pooling")
    async def create_pooling(request: EmbeddingRequest, raw: Request) -> Response:
        return await pooling.embeddings(request, raw, "pooling")

    @app.post("/score")
    @app.post("/v1/score")  # vLLM serves both
    async def create_score(request: ScoreRequest, raw: Request) -> Response:
        return await pooling.score(request, raw)


__all__ = ["POOLING_PATHS", "OpenAIServingPooling", "register_pooling_routes"]
