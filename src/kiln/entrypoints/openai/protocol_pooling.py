"""Request bodies of the pooling routes (``--runner pooling``), with OpenAI's and vLLM's names:
``POST /v1/embeddings`` and ``/pooling`` (``EmbeddingRequest``) and ``POST /score``
(``ScoreRequest``). The contract of ``kiln.entrypoints.openai.protocol`` holds (unknown fields
allowed, null means the default, types and simple ranges only); how many inputs a request may
hold is checked here, their token counts by the engine's input processor.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt

from kiln.entrypoints.openai.protocol import Int, RequestBody

MAX_INPUTS = 2048
"""The most inputs one embeddings or pooling request may hold (OpenAI's limit), and the most
texts on either side of a score request."""

TokenIds = list[StrictInt]
Text = Annotated[str, Field(max_length=2**20)]


class EmbeddingRequest(RequestBody):
    """``POST /v1/embeddings`` (OpenAI's) and ``POST /pooling`` (vLLM's, the same body)."""

    model: str | None = None
    input: Text | list[Text] | TokenIds | list[TokenIds]
    """A text, texts, token ids (used as given: no BOS is added) or lists of token ids; at most
    ``MAX_INPUTS`` inputs (checked by the route, which names ``input``)."""
    encoding_format: Literal["float", "base64"] = "float"
    """``float``: lists of numbers; ``base64``: each vector's float32 little-endian bytes."""
    dimensions: Annotated[int, Field(ge=1, le=2**31)] | None = None
    """Keep the first ``dimensions`` values, then normalise (Matryoshka truncation)."""
    user: str | None = None
    """OpenAI's end-user id; accepted and not used."""
    # vLLM extras
    normalize: bool | None = None
    """L2-normalise each vector; null: the server's ``--pooler-config`` ``normalize``."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31)] | None = None
    """Keep each input's last this many tokens (-1: the context length)."""
    add_special_tokens: bool = True
    """Tokenize a text input with the model's BOS policy."""
    request_id: str | None = None
    priority: Int = 0


class ScoreRequest(RequestBody):
    """``POST /score`` (vLLM's): ``text_1`` against each of ``text_2`` (one text), or pair by
    pair (two lists of the same length); the score is the cosine similarity of the two
    embeddings."""

    model: str | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    """Each side one text or at most ``MAX_INPUTS`` (checked by the route, naming the side)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31)] | None = None
    add_special_tokens: bool = True
    request_id: str | None = None
    priority: Int = 0


__all__ = ["MAX_INPUTS", "EmbeddingRequest", "ScoreRequest"]
