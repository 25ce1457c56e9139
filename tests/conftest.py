"""Fixtures shared by every test directory: the default model and a ``transformers`` reference
built from the same GGUF (``kiln.testing.reference``). Session-scoped: building the reference
takes several seconds.

A missing default model is a test *failure*, never a skip: skipping would turn every engine and
server test into a skip and leave CI green while testing nothing. ``scripts/bootstrap.sh`` installs
the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from kiln.model_executor.loader.default_model import DefaultModelNotFoundError, default_model_path
from kiln.testing.reference import hf_greedy, hf_logits, hf_model_from_gguf

MISSING_MODEL_HINT = (
    "the default model is required by the engine and server tests; install it (and the test "
    "tools) with `scripts/bootstrap.sh --test`"
)


def require_default_model() -> str:
    """The default model's GGUF path; fails the calling test (not a skip) when it is missing."""
    try:
        return default_model_path()
    except DefaultModelNotFoundError as exc:
        pytest.fail(f"{exc}\n{MISSING_MODEL_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return require_default_model()


@pytest.fixture(scope="session")
def hf_model(gguf_path: str) -> torch.nn.Module:
    return hf_model_from_gguf(gguf_path)


def hf_logprobs(hf_model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 ``log_softmax`` of the logits at every position: row ``p``
    is the distribution of token ``p + 1``."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([list(token_ids)])).logits[0]
    return logits.float().log_softmax(dim=-1)


@pytest.fixture(scope="session")
def hf_ref() -> SimpleNamespace:
    """``transformers`` reference helpers: ``greedy(model, prompt, n)``, ``logits(model, ids)``
    (last position) and ``logprobs(model, ids)`` (every position)."""
    return SimpleNamespace(greedy=hf_greedy, logits=hf_logits, logprobs=hf_logprobs)
