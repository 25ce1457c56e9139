"""The scheduler's admission rules (``kiln.scheduler.admission``) on their own, with hand-made
requests: LoRA slots hold back a request for another adapter while every slot is taken; a request
that asked for prompt logprobs may not reuse prefix-cache hits; the base rule admits anything."""

from __future__ import annotations

from kiln.lora.request import LoRARequest
from kiln.sampling_params import SamplingParams
from kiln.scheduler.admission import AdmissionRule, LoRASlots, PromptLogprobsPrefix
from kiln.scheduler.request import Request


def _request(request_id: str, lora_id: int | None = None, **params) -> Request:
    lora = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, **params), lora_request=lora)


def test_lora_slots_admit_running_adapters_and_new_ones_while_a_slot_is_free() -> None:
    rule = LoRASlots(max_loras=2)
    rule.begin_step([_request("r1", 1), _request("base")])
    assert rule.can_admit(_request("w0"))  # the base model needs no slot
    assert rule.can_admit(_request("w1", 1))  # its adapter runs already
    second = _request("w2", 2)
    assert rule.can_admit(second)
    rule.admit(second)
    assert not rule.can_admit(_request("w3", 3))  # both slots are taken now
    assert rule.can_admit(_request("w4", 2))
    rule.begin_step([_request("r1", 1)])  # a new step: what runs then counts
    assert rule.can_admit(_request("w3", 3))


def test_prompt_logprobs_recompute_the_prefix_and_the_base_rule_admits_all() -> None:
    plain, asking = _request("plain"), _request("asking", prompt_logprobs=2)
    assert PromptLogprobsPrefix().may_reuse_prefix(plain)
    assert not PromptLogprobsPrefix().may_reuse_prefix(asking)
    base = AdmissionRule()
    base.begin_step([])
    assert base.can_admit(asking) and base.may_reuse_prefix(asking)
