"""The scheduler with structured outputs, no model: grammars compile off the loop (a request
waits for its own without stalling the others), bitmask rows follow the grammar, matchers advance
with the sampled tokens, and a compile that fails or overruns ends only its request.

The grammars are real (xgrammar and llguidance on the default model's tokenizer); the "model" is
a runner that samples the lowest token the step's bitmask allows, so what it generates is what
the mask lets through.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future

import numpy as np
import pytest

from kiln.config import StructuredOutputsConfig
from kiln.messages import FinishReason, ModelRunnerOutput, SchedulerOutput
from kiln.sampling_params import StructuredOutputsParams
from kiln.scheduler.request import RequestStatus
from kiln.scheduler.scheduler import Scheduler
from kiln.structured_output.manager import valid_drafts
from kiln.testing.scheduler import make_request, make_scheduler
from kiln.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return load_tokenizer(gguf_path)


def grammar_scheduler(tokenizer, backend="auto", num_blocks=64, **structured_outputs):
    """``make_scheduler`` with structured outputs on ``backend`` (``structured_outputs``: other
    fields of ``StructuredOutputsConfig``), handed the default model's tokenizer."""
    config = StructuredOutputsConfig(backend=backend, **structured_outputs)
    return make_scheduler(num_blocks, structured_outputs=config, tokenizer=tokenizer)


def grammar_request(tokenizer, request_id, structured=None, max_tokens=24, prompt=(5, 6, 7)):
    return make_request(
        request_id,
        prompt,
        eos_token_id=tokenizer.eos_token_id,
        max_tokens=max_tokens,
        structured_outputs=structured,
    )


def lowest_allowed(bitmask_row: np.ndarray) -> int:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


def step(scheduler: Scheduler, seen: list[SchedulerOutput]):
    so = scheduler.schedule()
    seen.append(so)
    rows = {req_id: i for i, req_id in enumerate(so.structured_output_request_ids)}
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens + so.num_scheduled_tokens[req_id] < request.num_tokens:
            sampled.append([])
        elif req_id in rows:
            sampled.append([lowest_allowed(so.grammar_bitmask[rows[req_id]])])
        else:
            sampled.append([100])
    output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    return scheduler.update_from_output(so, output)


def run(scheduler, max_steps=200):
    texts: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    seen: list[SchedulerOutput] = []
    scheduler.num_preempted = 0  # summed over the steps' stats
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        outputs = step(scheduler, seen)
        scheduler.num_preempted += outputs.scheduler_stats.num_preemptions
        for out in outputs.outputs:
            texts.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out
    return texts, finish, seen


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_the_mask_decides_the_output_and_eos_comes_when_the_grammar_is_complete(tokenizer, backend):
    scheduler = grammar_scheduler(tokenizer, backend)
    scheduler.add_request(
        grammar_request(tokenizer, "r", StructuredOutputsParams(regex=r"(ab|cd)[0-9]{3}"))
    )
    scheduler.add_request(
        grammar_request(tokenizer, "c", StructuredOutputsParams(choice=["yes", "no"]))
    )
    tokens, finish, _ = run(scheduler)
    eos = tokenizer.eos_token_id
    for request_id, pattern in (("r", r"(ab|cd)[0-9]{3}"), ("c", "yes|no")):
        assert tokens[request_id][-1] == eos, tokens[request_id]
        assert finish[request_id].finish_reason == FinishReason.STOP
        text = tokenizer.decode(tokens[request_id][:-1])
        assert re.fullmatch(pattern, text), text


def test_a_request_waiting_for_its_grammar_does_not_stall_the_others(tokenizer):
    scheduler = grammar_scheduler(tokenizer)
    manager = scheduler.structured_output_manager
    slow: Future = Future()  # a compile that has not finished yet
    real_submit = manager.submit
    manager.submit = lambda params: slow
    scheduler.add_request(
        grammar_request(tokenizer, "slow", StructuredOutputsParams(regex="[0-9]+"))
    )
    manager.submit = real_submit
    scheduler.add_request(grammar_request(tokenizer, "plain", max_tokens=3))
    seen: list[SchedulerOutput] = []
    for _ in range(3):
        step(scheduler, seen)
    assert all("slow" not in so.num_scheduled_tokens for so in seen)
    assert "plain" not in scheduler.requests  # done: 3 tokens while "slow" waited
    assert scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.get_request_counts() == (0, 1)
    slow.set_result(real_submit(StructuredOutputsParams(regex="[0-9]+")).result(timeout=30))
    tokens, finish, seen = run(scheduler)
    assert seen[0].structured_output_request_ids == ["slow"]
    assert re.fullmatch("[0-9]+", tokenizer.decode(tokens["slow"][:-1]))


def test_a_compile_past_the_limit_or_failing_ends_only_its_request(tokenizer):
    scheduler = grammar_scheduler(tokenizer, max_compile_seconds=0.05)
    manager = scheduler.structured_output_manager
    real_submit = manager.submit
    manager.submit = lambda params: Future()  # never finishes
    scheduler.add_request(grammar_request(tokenizer, "stuck", StructuredOutputsParams(regex="a")))
    manager.submit = real_submit
    # Past the admission check (which refuses this spec): the engine must still survive it.
    bad = grammar_request(tokenizer, "bad", StructuredOutputsParams(grammar="root ::= undefined"))
    scheduler.add_request(bad)
    scheduler.add_request(grammar_request(tokenizer, "plain", max_tokens=2))
    time.sleep(0.1)
    _, finish, _ = run(scheduler)
    assert finish["plain"].finish_reason == FinishReason.LENGTH
    for request_id, message in (("stuck", "did not compile within 0.05 s"), ("bad", "undefined")):
        assert finish[request_id].finish_reason == FinishReason.ERROR
        assert message in finish[request_id].stop_reason
    assert not scheduler.has_unfinished_requests()


def test_grammars_are_cached_by_spec(tokenizer):
    manager = grammar_scheduler(tokenizer).structured_output_manager
    first = manager.submit(StructuredOutputsParams(json={"type": "object", "required": []}))
    same = manager.submit(StructuredOutputsParams(json='{"required": [], "type": "object"}'))
    other = manager.submit(StructuredOutputsParams(json={"type": "array"}))
    assert first is same and first is not other
    first.result(timeout=30)


def test_preemption_keeps_the_matcher_and_the_output_valid(tokenizer):
    # 11 usable blocks of 4 slots: two requests of 3 + up to 41 tokens cannot both fit.
    scheduler = grammar_scheduler(tokenizer, num_blocks=12)
    pattern = r"[a-z]{20}[0-9]{20}"
    for i in range(2):
        scheduler.add_request(
            grammar_request(
                tokenizer, f"p{i}", StructuredOutputsParams(regex=pattern), max_tokens=41
            )
        )
    tokens, finish, _ = run(scheduler, max_steps=400)
    assert scheduler.num_preempted > 0
    for i in range(2):
        assert finish[f"p{i}"].finish_reason == FinishReason.STOP
        assert re.fullmatch(pattern, tokenizer.decode(tokens[f"p{i}"][:-1]))


def test_with_a_reasoning_parser_the_grammar_starts_after_the_thinking(tokenizer):
    scheduler = grammar_scheduler(tokenizer, reasoning_parser="qwen3")
    pattern = r"(ab|cd)[0-9]{3}"
    scheduler.add_request(grammar_request(tokenizer, "r", StructuredOutputsParams(regex=pattern)))
    # The "model" thinks (tokens the grammar forbids), then samples the lowest allowed token.
    thinking = tokenizer.encode("<think>Let me see.</think>", add_special_tokens=False)
    every_token = np.full(scheduler.structured_output_manager.allocate_bitmask(1).shape[1], -1)
    tokens: list[int] = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        if not so.num_scheduled_tokens:  # the grammar is still compiling
            scheduler.update_from_output(so, ModelRunnerOutput([], {}, []))
            continue
        (row,) = so.grammar_bitmask
        if len(tokens) < len(thinking):
            assert (row == every_token).all()  # the grammar waits for the end of the thinking
            token = thinking[len(tokens)]
        else:
            assert not (row == every_token).all()
            token = lowest_allowed(row)
        tokens.append(token)
        output = ModelRunnerOutput(["r"], {"r": 0}, [[token]])
        (out,) = scheduler.update_from_output(so, output).outputs
    assert out.finish_reason == FinishReason.STOP and tokens[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(tokens[:-1])
    assert text.startswith("<think>Let me see.</think>")
    assert re.fullmatch(pattern, text.removeprefix("<think>Let me see.</think>")), text


@pytest.mark.parametrize("prompt_text", ["Answer: <think>\n\n</think>\n\n", "Answer: "])
def test_a_prompt_that_closed_the_thinking_or_enable_in_reasoning_starts_the_grammar_at_once(
    tokenizer, prompt_text
):
    # Without tags in the prompt, only enable_in_reasoning applies the grammar from the start.
    scheduler = grammar_scheduler(
        tokenizer, reasoning_parser="qwen3", enable_in_reasoning="<think>" not in prompt_text
    )
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    scheduler.add_request(
        grammar_request(
            tokenizer, "c", StructuredOutputsParams(choice=["yes", "no"]), prompt=prompt
        )
    )
    tokens, finish, _ = run(scheduler)
    assert finish["c"].finish_reason == FinishReason.STOP
    # Every token is the grammar's, the first one included.
    assert tokenizer.decode(tokens["c"][:-1], skip_special_tokens=False) in ("yes", "no")


# -- speculative decoding: drafts checked against the grammar, a bitmask row per position --------


def allowed_row(scheduler, request, tokens) -> np.ndarray:
    """The bitmask row of a fresh matcher of ``request``'s grammar fed ``tokens``: what the
    grammar allows after them (every token once it has terminated)."""
    manager = scheduler.structured_output_manager
    matcher = manager.make_matcher(request.grammar, request.prompt_token_ids)
    for token_id in tokens:
        assert matcher.accept_token(token_id)
    bitmask = manager.allocate_bitmask(1)
    if not matcher.is_terminated():
        matcher.fill_bitmask(bitmask, 0)
    return bitmask.numpy()[0]


def drafted(so: SchedulerOutput, tokens: list[int], drafts: list[int]) -> ModelRunnerOutput:
    """The runner emitted ``tokens`` for the step's one request and drafted ``drafts``."""
    (req_id,) = so.num_scheduled_tokens
    return ModelRunnerOutput([req_id], {req_id: 0}, [tokens], spec_token_ids=[drafts])


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_drafts_are_cut_at_the_first_the_grammar_forbids_and_get_a_row_each(tokenizer, backend):
    scheduler = grammar_scheduler(tokenizer, backend)
    scheduler.add_request(
        grammar_request(tokenizer, "r", StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2}"))
    )
    ab, a, one, two, three = (tokenizer.encode(t)[0] for t in ("ab", "a", "1", "2", "3"))
    assert tokenizer.decode([ab, a, one, two, three]) == "aba123"
    eos = tokenizer.eos_token_id
    so = scheduler.schedule()
    while not so.num_scheduled_tokens:  # the grammar is still compiling
        scheduler.update_from_output(so, ModelRunnerOutput([], {}, []))
        so = scheduler.schedule()
    request = scheduler.requests["r"]

    # "ab" is sampled; of the drafts "1", "a", "2" the grammar forbids "a": the rest goes too.
    scheduler.update_from_output(so, drafted(so, [ab], [one, a, two]))
    assert request.spec_token_ids == [one]
    # The matcher is where "ab" left it: the drafts it checked are rolled back.
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [one]}
    assert so.num_scheduled_tokens == {"r": 2}
    assert so.structured_output_request_ids == ["r"]
    assert so.grammar_bitmask.shape[0] == 2  # the position of the draft, then the bonus one
    for j, tokens in enumerate(([ab], [ab, one])):
        assert (so.grammar_bitmask[j] == allowed_row(scheduler, request, tokens)).all(), j

    # "1" is rejected, "2" emitted instead: the matcher takes "2" only. The stop token is a draft
    # the complete grammar allows; nothing may follow it.
    scheduler.update_from_output(so, drafted(so, [two], [three, eos, one]))
    assert request.output_token_ids == [ab, two]
    assert request.spec_token_ids == [three, eos]
    so = scheduler.schedule()
    assert so.grammar_bitmask.shape[0] == 3
    for j, tokens in enumerate(([ab, two], [ab, two, three], [ab, two, three, eos])):
        assert (so.grammar_bitmask[j] == allowed_row(scheduler, request, tokens)).all(), j
    assert (so.grammar_bitmask[2] == -1).all()  # after the stop token: never emitted

    (out,) = scheduler.update_from_output(so, drafted(so, [three, eos], [])).outputs
    assert out.finish_reason == FinishReason.STOP
    assert tokenizer.decode(out.new_token_ids[:-1]) == "3"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_valid_drafts_leave_the_matcher_as_it_was(tokenizer, backend):
    scheduler = grammar_scheduler(tokenizer, backend)
    request = grammar_request(tokenizer, "r", StructuredOutputsParams(choice=["yes", "no"]))
    scheduler.add_request(request)
    request.grammar.result(timeout=30)
    manager = scheduler.structured_output_manager
    matcher = manager.make_matcher(request.grammar)
    yes, no, eos = tokenizer.encode("yes")[0], tokenizer.encode("no")[0], tokenizer.eos_token_id
    assert valid_drafts(matcher, [no, yes]) == [no]
    assert valid_drafts(matcher, [yes, eos, eos]) == [yes, eos]
    assert not matcher.is_terminated()
    # It still starts at the beginning: "no" then the stop token, and nothing after.
    assert (
        manager.fill_bitmask([matcher])
        == manager.fill_bitmask([manager.make_matcher(request.grammar)])
    ).all()
    assert matcher.accept_token(no) and matcher.accept_token(eos) and matcher.is_terminated()
    assert valid_drafts(matcher, [eos]) == []


def test_a_reasoning_matcher_rolls_back_across_the_end_of_the_thinking(tokenizer):
    scheduler = grammar_scheduler(tokenizer, reasoning_parser="qwen3")
    request = grammar_request(tokenizer, "r", StructuredOutputsParams(choice=["yes", "no"]))
    scheduler.add_request(request)
    request.grammar.result(timeout=30)
    manager = scheduler.structured_output_manager
    thinking = tokenizer.encode("<think>Hm.</think>", add_special_tokens=False)
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    matcher = manager.make_matcher(request.grammar, request.prompt_token_ids)
    for token_id in thinking[:2]:
        assert matcher.accept_token(token_id)
    # The rest of the thinking, then "yes": accepted as drafts, then rolled back.
    assert valid_drafts(matcher, [*thinking[2:], yes, no]) == [*thinking[2:], yes]
    assert not matcher.is_reasoning_ended
    every_token = manager.allocate_bitmask(1).numpy()
    assert (manager.fill_bitmask([matcher]) == every_token).all()
    for token_id in thinking[2:]:
        assert matcher.accept_token(token_id)
    assert matcher.is_reasoning_ended and matcher.accept_token(no)


def _mask_size_after_brace(tokenizer, structured: StructuredOutputsParams, **json_options) -> int:
    """How many tokens ``structured``'s grammar allows after ``{``, on a server with
    ``json_options`` (``StructuredOutputsConfig`` fields)."""
    scheduler = grammar_scheduler(tokenizer, "xgrammar", **json_options)
    scheduler.add_request(grammar_request(tokenizer, "j", structured))
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        so = scheduler.schedule()
        if so.grammar_bitmask is not None:
            if scheduler.requests["j"].num_output_tokens:
                bits = np.unpackbits(so.grammar_bitmask[0].view(np.uint8), bitorder="little")
                return int(bits.sum())
            scheduler.update_from_output(so, ModelRunnerOutput(["j"], {"j": 0}, [[brace]]))
            continue
        scheduler.update_from_output(so, ModelRunnerOutput([], {}, []))
        time.sleep(0.01)
    raise AssertionError("the grammar never compiled")


def test_disable_any_whitespace_as_a_server_default_or_per_request(tokenizer):
    """The server's option (``--structured-outputs-config '{"disable_any_whitespace": true}'``)
    gives every JSON grammar the mask the request's own option gives: no whitespace tokens."""
    loose = _mask_size_after_brace(tokenizer, StructuredOutputsParams(json_object=True))
    per_request = _mask_size_after_brace(
        tokenizer, StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    )
    by_server = _mask_size_after_brace(
        tokenizer, StructuredOutputsParams(json_object=True), disable_any_whitespace=True
    )
    assert by_server == per_request < loose
