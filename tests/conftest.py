"""Fixtures shared by every test directory: the default model and a ``transformers`` reference
built from the same GGUF (``kiln.testing.reference``). Session-scoped: building the reference
takes several seconds.

The core tests run on the reference ``cpu`` platform (see ``pytest_runtest_protocol`` below);
kiln-x86's own tests (plugins/kiln-x86/tests) and its conformance kit cover kiln-x86.

A missing default model is a test *failure*, never a skip: skipping would turn every engine and
server test into a skip and leave CI green while testing nothing. ``scripts/bootstrap.sh`` installs
the model.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: threads that wait passively. On a shared, busy machine
# spinning OpenMP threads made each engine step ~5x slower (a 12-token generate: 30 s vs 6 s).
# Also inherited by the `kiln serve` processes the server tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln import LLM
from kiln.model_executor.loader.default_model import DefaultModelNotFoundError, default_model_path
from kiln.outputs import PositionLogprobs
from kiln.plugins.manager import PLATFORM_ENV
from kiln.testing.reference import hf_greedy, hf_logits, hf_model_from_gguf

TESTS_DIR = Path(__file__).parent

# The platform the core tests' engines select, in this process and in the ones they start, unless
# the run names one itself (KILN_PLATFORM=x86 runs them on kiln-x86). Detection would pick kiln-x86
# on x86-64 where it is installed, whose every engine start traces its decode graphs.
DEFAULT_TEST_PLATFORM = os.environ.get(PLATFORM_ENV) or "cpu"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Sets ``KILN_PLATFORM`` for each core test's set-up, call and tear-down (fixtures that start
    an engine or a server included), and only for those: kiln-x86's tests, which this hook also
    sees, select by detection. This process selects its own platform once, at its first engine,
    so every core test must run with it; a test of selection clears it for the processes it
    starts (tests/plugins/conftest.py), as does ``KilnServer(detect_platform=True)``."""
    if not item.path.is_relative_to(TESTS_DIR):
        return (yield)
    previous = os.environ.get(PLATFORM_ENV)
    os.environ[PLATFORM_ENV] = DEFAULT_TEST_PLATFORM
    try:
        return (yield)
    finally:
        if previous is None:
            os.environ.pop(PLATFORM_ENV, None)
        else:
            os.environ[PLATFORM_ENV] = previous


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
def llm_f32(gguf_path: str) -> LLM:
    """A float32 ``LLM`` of the default model (whole prefill, prefix caching on), shared by the
    tests that compare Kiln with ``transformers``. Tests must not change its state for others."""
    return LLM(gguf_path, dtype="float32", kv_cache_memory=0.25, max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="session")
def hf_model(gguf_path: str) -> torch.nn.Module:
    return hf_model_from_gguf(gguf_path)


def hf_logprobs(hf_model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 ``log_softmax`` of the logits at every position: row ``p``
    is the distribution of token ``p + 1``."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([list(token_ids)])).logits[0]
    return logits.float().log_softmax(dim=-1)


# Kiln and transformers, both float32, differ by ~2e-5 nats on the default model; a real bug (a
# position off by one, logits of the wrong row) moves logprobs by whole nats.
LOGPROB_ATOL = 2e-3


def check_position_logprobs(
    got: PositionLogprobs,
    reference: torch.Tensor,
    token_id: int,
    num_top: int,
    where: str = "",
    atol: float = LOGPROB_ATOL,
) -> None:
    """Asserts that ``got`` (one position of Kiln's logprobs: the chosen token, then the top
    ``num_top``) matches ``reference`` ([vocab] float32 logprobs from ``transformers``): the same
    token ids, values within ``atol`` and ranks consistent with the reference."""
    top_ids = reference.topk(num_top).indices.tolist() if num_top else []
    assert set(got) == {token_id, *top_ids}, f"{where}: token ids {sorted(got)}"
    for tid, logprob in got.items():
        expected = float(reference[tid])
        assert abs(logprob.logprob - expected) <= atol, (
            f"{where}: token {tid} logprob {logprob.logprob} != transformers' {expected}"
        )
        # Rank: 1 + tokens strictly more likely; tokens within the tolerance may fall either way.
        surely_above = int((reference > expected + atol).sum())
        maybe_above = int((reference > expected - atol).sum()) - 1
        assert logprob.rank is not None and surely_above + 1 <= logprob.rank <= maybe_above + 1, (
            f"{where}: token {tid} rank {logprob.rank}"
        )


@pytest.fixture(scope="session")
def hf_ref() -> SimpleNamespace:
    """``transformers`` reference helpers: ``greedy(model, prompt, n)``, ``logits(model, ids)``
    (last position), ``logprobs(model, ids)`` (every position) and
    ``check_position(got, reference_row, token_id, num_top, where)``."""
    return SimpleNamespace(
        greedy=hf_greedy,
        logits=hf_logits,
        logprobs=hf_logprobs,
        check_position=check_position_logprobs,
    )
