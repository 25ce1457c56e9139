"""Structured outputs in the scheduler (``kiln.structured_output``): the requests whose grammar is
compiling, and the bitmask of a step's structured requests.

A request with ``structured_outputs`` waits in ``WAITING_FOR_GRAMMAR``, outside the waiting queue,
while its grammar compiles in a thread; each ``schedule()`` first takes the ready ones out
(``GrammarWaitlist.take_done``) and queues them, and finishes with finish reason "error" those
whose compile failed or ran past ``structured_outputs.max_compile_seconds``, so the others are
scheduled meanwhile. For the requests that sample in a step it fills one bitmask row each, or
``1 + k`` for a request verifying ``k`` drafts (``SchedulerOutput.grammar_bitmask``);
``update_from_output`` advances each request's matcher by its new tokens and keeps of the
runner's drafts those its grammar allows (``valid_drafts``). A preempted request keeps its
matcher: its output tokens stay.

This module knows the requests and the grammar manager, not the scheduler's queues.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import numpy as np

from kiln.scheduler.request import Request, RequestStatus
from kiln.structured_output import StructuredOutputManager
from kiln.structured_output.manager import grammar_failure, valid_drafts

logger = logging.getLogger(__name__)

_GRAMMAR_POLL_SECONDS = 0.005
"""While only grammar compiles are pending, ``take_done`` waits this long for one instead of
letting the engine loop spin against the compiling threads."""


class GrammarWaitlist:
    """The requests whose grammar is compiling, in arrival order."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar. Side effects: sets its ``grammar``, status
        ``WAITING_FOR_GRAMMAR`` and ``grammar_wait_start``."""
        assert request.sampling_params.structured_outputs is not None
        request.grammar = self.manager.submit(request.sampling_params.structured_outputs)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        request.grammar_wait_start = time.monotonic()
        self.requests.append(request)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def take_done(self, is_idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Take out the requests whose compile is over: those ready (their ``matcher`` made),
        and those whose compile failed or ran past ``max_compile_seconds``, with the error. With
        ``is_idle`` (nothing else to run) it first waits briefly for a compile."""
        if is_idle:
            concurrent.futures.wait(
                [r.grammar for r in self.requests if r.grammar is not None],
                timeout=_GRAMMAR_POLL_SECONDS,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        now = time.monotonic()
        max_seconds = self.manager.max_compile_seconds
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        pending: list[Request] = []
        for request in self.requests:
            grammar = request.grammar
            assert grammar is not None
            if grammar.done():
                try:
                    request.matcher = self.manager.make_matcher(grammar, request.prompt_token_ids)
                    ready.append(request)
                except Exception as exc:  # a compile error of any kind ends this request only
                    failed.append((request, f"structured_outputs: {exc}"))
            elif now - request.grammar_wait_start > max_seconds:
                error = (
                    f"structured_outputs: the grammar did not compile within {max_seconds} s "
                    "(structured_outputs.max_compile_seconds)"
                )
                failed.append((request, error))
            else:
                pending.append(request)
        self.requests = pending
        return ready, failed


def grammar_bitmask(
    manager: StructuredOutputManager,
    requests: dict[str, Request],
    num_scheduled_tokens: dict[str, int],
    spec_tokens: dict[str, list[int]],
    errors: dict[str, str],
) -> tuple[list[str], np.ndarray | None]:
    """The structured requests that sample this step, and their bitmask rows in that order: one
    each, or ``1 + k`` for a request verifying ``k`` drafts (``spec_tokens``; see
    ``StructuredOutputManager.fill_bitmask``). A request whose grammar raised goes into
    ``errors`` (request id -> message), its rows allowing every token: the caller fails it."""
    req_ids: list[str] = []
    matchers = []
    drafts = []
    for request_id, num_tokens in num_scheduled_tokens.items():
        request = requests[request_id]
        if (
            request.matcher is not None
            and request.num_computed_tokens + num_tokens >= request.num_tokens
        ):
            req_ids.append(request_id)
            matchers.append(request.matcher)
            drafts.append(spec_tokens.get(request_id, []))
    if not matchers:
        return req_ids, None
    failed: dict[int, str] = {}
    bitmask = manager.fill_bitmask(matchers, drafts, failed)
    errors.update((req_ids[index], message) for index, message in failed.items())
    return req_ids, bitmask


def accept_token(request: Request, token_id: int, errors: dict[str, str]) -> bool:
    """Advance ``request``'s grammar by ``token_id``. False when the grammar raised: the
    request is then in ``errors`` (request id -> message; the caller fails it), not the step."""
    assert request.matcher is not None
    try:
        if not request.matcher.accept_token(token_id):
            logger.error(
                "request %s: token %d is not allowed by its grammar", request.request_id, token_id
            )
    except Exception as exc:
        errors[request.request_id] = grammar_failure(exc)
        return False
    return True


def allowed_drafts(request: Request, drafts: list[int], errors: dict[str, str]) -> list[int]:
    """The runner's ``drafts`` for ``request``'s next step, cut where its grammar (which has
    taken this step's tokens) forbids one; none when the grammar raised (now, into ``errors``,
    or before: the request is in ``errors`` already)."""
    if request.matcher is None or not drafts:
        return drafts
    if request.request_id in errors:
        return []
    try:
        return valid_drafts(request.matcher, drafts)
    except Exception as exc:
        errors[request.request_id] = grammar_failure(exc)
        return []


__all__ = ["GrammarWaitlist", "accept_token", "allowed_drafts", "grammar_bitmask"]
