"""The engine core's side of structured outputs: compile grammars off the loop, fill bitmasks.

Contract (vLLM v1's ``StructuredOutputManager``):

- ``submit(params)`` starts compiling a request's grammar in a thread pool and returns at once;
  compiles are cached by ``(backend, kind, spec)``, so a second request with the same schema
  shares the first one's (even while it still compiles). The scheduler keeps such a request in
  ``WAITING_FOR_GRAMMAR`` and schedules the others meanwhile.
- ``make_matcher(future, prompt_token_ids)`` makes the request's own matcher once the compile is
  done (each child of an ``n > 1`` request gets its own). With a reasoning parser
  (``structured_outputs.reasoning_parser``) the matcher lets every token through and does not
  advance until the parser sees the thinking end, in the prompt or the output (vLLM's rule: the
  token that ends it is not fed to the grammar; the next one is its first), unless
  ``structured_outputs.enable_in_reasoning``.
- ``fill_bitmask(matchers, drafts)`` fills one row per matcher, for the requests that sample this
  step, or with speculative decoding ``1 + k`` rows for a request verifying ``k`` drafts (row
  ``j``: what its grammar allows after its first ``j`` drafts; the matcher accepts the drafts to
  fill them, then rolls them back); the rows travel to the runner in
  ``SchedulerOutput.grammar_bitmask``. ``valid_drafts`` cuts a request's drafts at the first one
  its grammar forbids, so every draft it verifies has a row.

The tokenizer (needed by the grammar engines) is loaded on the first structured request, so
engines that never see one pay nothing.

What it must not know: scheduling policy, the model, devices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kiln.config import MAX_NUM_SPECULATIVE_TOKENS, KilnConfig
from kiln.reasoning import ReasoningParser, resolve_reasoning_parser
from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.backends import BACKEND_CLASSES, Grammar, Matcher, choose_backend

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first)."""


def load_config_tokenizer(config: KilnConfig) -> Any:
    """The model's tokenizer, as the front end loads it."""
    from kiln.model_executor.loader import get_loader, resolve_model_ref
    from kiln.tokenizer import load_tokenizer

    model_ref = resolve_model_ref(config.model.model)
    loader = get_loader(model_ref, config.model.load_format)
    return load_tokenizer(config.model.tokenizer or loader.tokenizer_source(model_ref))


class StructuredOutputManager:
    """Grammar compiles (threads, cache) and bitmasks for one engine core.

    Args:
        config: reads ``structured_outputs.*`` and ``model.*`` (to load the tokenizer).
        vocab_size: the logits' width; bitmask rows cover ``ceil(vocab_size / 32)`` words.
        load_tokenizer: ``config -> Tokenizer``; the default loads the model's.

    Raises:
        ValueError: ``structured_outputs.reasoning_parser`` names no registered parser.
    """

    def __init__(
        self,
        config: KilnConfig,
        vocab_size: int | None = None,
        load_tokenizer: Callable[[KilnConfig], Any] = load_config_tokenizer,
    ) -> None:
        self.config = config
        self.backend_name = config.structured_outputs.backend
        self.max_compile_seconds = config.structured_outputs.max_compile_seconds
        self._vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._backends: dict[str, Any] = {}
        self._lock = threading.RLock()  # the backends are built in pool threads
        self._cache: OrderedDict[tuple[str, tuple], Future[Grammar]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        name = config.structured_outputs.reasoning_parser
        reasoning_parser = resolve_reasoning_parser(name) if name is not None else None
        if config.structured_outputs.enable_in_reasoning:
            reasoning_parser = None  # the grammar applies from the first token
        self._reasoning_parser = reasoning_parser

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self._get_tokenizer().vocab_size
        assert self._vocab_size is not None
        return self._vocab_size

    def submit(self, params: StructuredOutputsParams) -> Future[Grammar]:
        """The compile of ``params``' grammar: cached, or started now in the pool.

        A spec no backend reads gives a future that raises ``ValueError`` (the front end checks
        specs first, so this is a guard). The server's JSON options
        (``structured_outputs.disable_any_whitespace``, ``disable_additional_properties``) apply
        to every request, beside the request's own.
        """
        params = self._with_server_options(params)
        try:
            backend_name = choose_backend(params, self.backend_name)
        except ValueError as exc:
            failed: Future[Grammar] = Future()
            failed.set_exception(exc)
            return failed
        key = (backend_name, params.key)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            num_threads = max(1, min(4, (os.cpu_count() or 1) // 2))
            self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kiln-grammar")
        future = self._executor.submit(self._compile, backend_name, params)
        self._cache[key] = future
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _with_server_options(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        config = self.config.structured_outputs
        # Any: mypy checks replace()'s keywords against each field's type, the names here vary.
        options: dict[str, Any] = {
            name: True
            for name in ("disable_any_whitespace", "disable_additional_properties")
            if getattr(config, name) and not getattr(params, name)
        }
        return dataclasses.replace(params, **options) if options else params

    def make_matcher(
        self, future: Future[Grammar], prompt_token_ids: Sequence[int] = ()
    ) -> Matcher:
        """A fresh matcher of a finished compile (raises what the compile raised); with a
        reasoning parser, one that waits for the end of the thinking (see the module doc)."""
        matcher = future.result(timeout=0).make_matcher()
        if self._reasoning_parser is None:
            return matcher
        parser = self._reasoning_parser()
        tokenizer = self._get_tokenizer()
        prompt = tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        if parser.is_reasoning_end(prompt):
            return matcher
        return AfterReasoningMatcher(matcher, parser, prompt, tokenizer.decode)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32, every token allowed."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_bitmask(
        self,
        matchers: Sequence[Matcher],
        drafts: Sequence[Sequence[int]] | None = None,
        errors: dict[int, str] | None = None,
    ) -> np.ndarray:
        """[sum of 1 + len(drafts[i]), ceil(V / 32)] int32: ``1 + len(drafts[i])`` rows per
        matcher, in order, row ``j`` of them what ``matchers[i]`` allows after ``drafts[i][:j]``
        (no drafts: one row each, what it allows next).

        ``drafts[i]`` must be allowed by ``matchers[i]`` (``valid_drafts``). A row after a
        terminated grammar (a draft was its stop token) allows every token: its token is never
        emitted, the request stops at the stop token.

        With ``errors``, a matcher that raises is recorded there (``errors[i]``, the message)
        with its rows allowing every token, and the others go on: the caller fails that request
        alone. Without it, the exception propagates.

        Side effects: none once it returns (each matcher rolls back the drafts it accepted).
        """
        drafts = drafts or [()] * len(matchers)
        bitmask = self.allocate_bitmask(sum(1 + len(d) for d in drafts))
        row = 0
        for index, (matcher, request_drafts) in enumerate(zip(matchers, drafts, strict=True)):
            try:
                _fill_rows(matcher, request_drafts, bitmask, row)
            except Exception as exc:
                if errors is None:
                    raise
                bitmask[row : row + 1 + len(request_drafts)] = -1
                errors[index] = grammar_failure(exc)
            row += 1 + len(request_drafts)
        return bitmask.numpy()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _get_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer(self.config)
            return self._tokenizer

    def _compile(self, backend_name: str, params: StructuredOutputsParams) -> Grammar:
        tokenizer = self._get_tokenizer()
        with self._lock:
            backend = self._backends.get(backend_name)
            if backend is None:
                backend = BACKEND_CLASSES[backend_name](
                    tokenizer.hf_tokenizer, self.vocab_size, sorted(tokenizer.eos_token_ids)
                )
                self._backends[backend_name] = backend
        return backend.compile(params)


def grammar_failure(exc: Exception) -> str:
    """The error a request whose grammar raised ``exc`` finishes with."""
    return f"structured_outputs: the grammar failed: {exc}"


def _fill_rows(
    matcher: Matcher, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int
) -> None:
    """Rows ``first_row ..`` of ``bitmask``: what ``matcher`` allows after each prefix of
    ``drafts`` (see ``StructuredOutputManager.fill_bitmask``)."""
    for j in range(len(drafts) + 1):
        if not matcher.is_terminated():
            matcher.fill_bitmask(bitmask, first_row + j)
        if j < len(drafts):
            is_allowed = matcher.accept_token(drafts[j])
            assert is_allowed, "a draft the grammar forbids (see valid_drafts)"
    if drafts:
        matcher.rollback(len(drafts))


def valid_drafts(matcher: Matcher, drafts: list[int]) -> list[int]:
    """The leading ``drafts`` that ``matcher``'s grammar allows in a row after the request's
    tokens: cut at the first it forbids (none after it terminates).

    Side effects: none once it returns (the matcher rolls back the drafts it accepted).
    """
    num_valid = 0
    for token_id in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        num_valid += 1
    if num_valid:
        matcher.rollback(num_valid)
    return drafts[:num_valid]


class AfterReasoningMatcher:
    """A matcher that starts once the thinking has ended: until then every token is allowed and
    the grammar does not advance. It rolls back up to ``MAX_NUM_SPECULATIVE_TOKENS`` tokens,
    across the end of the thinking too.

    Args:
        matcher: the grammar's matcher, advanced from the first token after the thinking.
        parser: says where the thinking ends (``ReasoningParser.is_reasoning_end``).
        text: the prompt's text; the output's is appended token by token.
        decode: ``(token_ids, skip_special_tokens) -> text``, the tokenizer's.
    """

    def __init__(
        self,
        matcher: Matcher,
        parser: ReasoningParser,
        text: str,
        decode: Callable[..., str],
    ) -> None:
        self._matcher = matcher
        self._parser = parser
        self._text = text
        self._decode = decode
        self.is_reasoning_ended = False
        # The state before each of the last accepted tokens, ``(text, is_reasoning_ended)``:
        # what ``rollback`` restores (the grammar's matcher rolls back the tokens it took).
        self._history: deque[tuple[str, bool]] = deque(maxlen=MAX_NUM_SPECULATIVE_TOKENS)

    def accept_token(self, token_id: int) -> bool:
        before = (self._text, self.is_reasoning_ended)
        if self.is_reasoning_ended:
            if not self._matcher.accept_token(token_id):
                return False
            self._history.append(before)
            return True
        # NOTE: one token at a time; an ASCII tag survives a multi-byte character cut in two.
        self._text += self._decode([token_id], skip_special_tokens=False)
        self.is_reasoning_ended = self._parser.is_reasoning_end(self._text)
        if self.is_reasoning_ended:
            self._text = ""  # not read again
        self._history.append(before)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert num_tokens <= len(self._history), (num_tokens, len(self._history))
        undone = [self._history.pop() for _ in range(num_tokens)]
        # The tokens accepted after the thinking ended went to the grammar.
        num_grammar_tokens = sum(is_ended for _, is_ended in undone)
        if num_grammar_tokens:
            self._matcher.rollback(num_grammar_tokens)
        if undone:
            self._text, self.is_reasoning_ended = undone[-1]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_reasoning_ended:
            self._matcher.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = -1

    def is_terminated(self) -> bool:
        return self.is_reasoning_ended and self._matcher.is_terminated()


def validate_structured_outputs(params: StructuredOutputsParams, backend: str) -> None:
    """The admission check: ``params`` compiles with the configured backend (``"auto"``: one).

    Raises:
        ValueError: names the field and the backend's complaint.
    """
    choose_backend(params, backend)
