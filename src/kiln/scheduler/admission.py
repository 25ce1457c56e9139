"""Admission rules: which waiting requests a step may take, as objects the scheduler composes.

The scheduler takes waiting requests in ``(priority, arrival)`` order while the budget,
``max_num_seqs`` and free blocks allow (``kiln.scheduler.scheduler``); each rule here may stop
that (``can_admit``: the request at the head waits, and holds back the queue behind it) or keep a
request from reusing prefix-cache hits (``may_reuse_prefix``). A rule hears of each step's start
(``begin_step``, with the running requests) and of each admission (``admit``). The base class
admits everything: a feature that is off has no rule.

Rules here: ``LoRASlots`` (a step fits ``lora.max_loras`` adapters), ``PromptLogprobsPrefix``
(prompt logprobs need logits at every prompt position) and ``PoolingPrefix`` (MEAN and CLS
pooling need hidden states a prefix hit would not compute). The other admission-time policies are
objects of their own: the grammar wait-list (``kiln.scheduler.grammar_waitlist``: a request is
queued only once its grammar compiled) and the pipeline's batches in flight
(``kiln.scheduler.pipeline``: a request in flight is not scheduled again).

This module knows requests only: no blocks, no budgets.
"""

from __future__ import annotations

from kiln.scheduler.request import Request


class AdmissionRule:
    """A rule on admitting waiting requests; this class admits every one."""

    def begin_step(self, running: list[Request]) -> None:
        """A step starts scheduling; ``running`` are the running requests (read only)."""

    def can_admit(self, request: Request) -> bool:
        """Whether ``request`` (the head of the queue) may start now."""
        return True

    def admit(self, request: Request) -> None:
        """``request`` was admitted in this step."""

    def may_reuse_prefix(self, request: Request) -> bool:
        """Whether ``request`` may skip the prompt tokens the prefix cache holds."""
        return True


class LoRASlots(AdmissionRule):
    """A request for an adapter that no running request uses waits while ``max_loras`` other
    adapters run: a step fits that many slots (``LoRAModelManager.set_active_loras``)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running_loras: set[int] = set()
        """The adapter ids of the running requests and those admitted in this step."""

    def begin_step(self, running: list[Request]) -> None:
        self.running_loras = {
            r.lora_request.lora_int_id for r in running if r.lora_request is not None
        }

    def can_admit(self, request: Request) -> bool:
        lora = request.lora_request
        return lora is None or len(self.running_loras | {lora.lora_int_id}) <= self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self.running_loras.add(request.lora_request.lora_int_id)


class PromptLogprobsPrefix(AdmissionRule):
    """A request that asked for prompt logprobs needs logits at every prompt position: it
    recomputes its cached prefix."""

    def may_reuse_prefix(self, request: Request) -> bool:
        return request.sampling_params.prompt_logprobs is None


class PoolingPrefix(AdmissionRule):
    """A pooling request whose pooler reads more than the last prompt position (MEAN: every
    position, CLS: the first) recomputes its cached prefix: a hit skips those positions'
    forward, so their hidden states would be missing. LAST reads only the last position, which
    is never a hit (``KVCacheManager.get_computed_blocks``), so it reuses the cache.

    Args:
        pooling_type: ``model.pooling_type``.
    """

    def __init__(self, pooling_type: str) -> None:
        self.needs_every_position = pooling_type != "LAST"

    def may_reuse_prefix(self, request: Request) -> bool:
        return request.pooling_params is None or not self.needs_every_position
