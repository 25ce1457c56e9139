"""The output processor, fed hand-made engine-core outputs: real text encoded to ids and fed one id
per step as if sampled."""

import pytest

from kiln.engine.input_processor import fan_out
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request_state import ParentRequest, make_position_logprobs
from kiln.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from kiln.model_executor.loader.default_model import default_model_path
from kiln.outputs import Logprob
from kiln.sampling_params import RequestOutputKind, SamplingParams
from kiln.tokenizer import load_tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)
PROMPT_IDS = [1, 4093, 198]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def make_request(request_id, arrival_time=0.0, **params):
    return EngineCoreRequest(request_id, PROMPT_IDS, SamplingParams(**params), 2, arrival_time)


def step_outputs(request_id, ids, finish_reason=FinishReason.LENGTH, stop_reason=None):
    """One EngineCoreOutput per id; the last finishes the request (unless finish_reason=None)."""
    outputs = [EngineCoreOutput(request_id, [token_id]) for token_id in ids]
    if finish_reason is not None:
        outputs[-1].finish_reason = finish_reason
        outputs[-1].stop_reason = stop_reason
    return outputs


def run(processor, request_id, ids, **finish):
    """Feed ``ids`` one per step; return every step's ProcessedOutputs."""
    return [processor.process_outputs([o]) for o in step_outputs(request_id, ids, **finish)]


def outputs_of(steps):
    return [ro for step in steps for ro in step.request_outputs]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_text_equals_full_decode_for_every_output_kind(tokenizer, kind):
    ids = tokenizer.encode("Streaming 😀 世界 text\n  with code: x = [1, 2]")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", output_kind=kind), "prompt")
    outputs = outputs_of(run(processor, "r", ids))
    assert not processor.has_unfinished_requests()
    assert all(len(o.outputs) == 1 for o in outputs)
    completions = [o.outputs[0] for o in outputs]
    if kind == FINAL_ONLY:
        assert len(outputs) == 1  # emitted once, when finished
    else:
        assert len(outputs) == len(ids)
    if kind == DELTA:
        text = "".join(c.text for c in completions)
        token_ids = [t for c in completions for t in c.token_ids]
    else:
        text, token_ids = completions[-1].text, completions[-1].token_ids
    assert text == tokenizer.decode(ids)
    assert token_ids == ids
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert completions[-1].finish_reason == "length"
    assert outputs[-1].prompt == "prompt" and outputs[-1].prompt_token_ids == PROMPT_IDS


def test_stop_string_finishes_the_request_and_asks_for_an_abort(tokenizer):
    ids = tokenizer.encode("Hello world, everyone")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", stop=["wor"]), None)
    steps = run(processor, "r", ids)
    assert steps[1].reqs_to_abort == ["r"]
    final = steps[1].request_outputs[0]
    assert final.finished
    completion = final.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        "Hello ",
        "stop",
        "wor",
    )
    assert completion.token_ids == ids[:2]
    # Outputs the engine core made before it saw the abort are ignored.
    assert all(s.request_outputs == [] and s.reqs_to_abort == [] for s in steps[2:])
    assert not processor.has_unfinished_requests()


def test_stop_string_in_the_last_token_is_not_aborted_again(tokenizer):
    ids = tokenizer.encode("Hello world")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", stop=["world"], include_stop_str_in_output=True), None)
    steps = run(processor, "r", ids)  # the core finished it (length) on the same token
    assert steps[-1].reqs_to_abort == []
    completion = steps[-1].request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        "Hello world",
        "stop",
        "world",
    )


@pytest.mark.parametrize("stop", [["lo wo"], ["world", "lo"], ["lo", "world"]])
def test_stop_spanning_tokens_and_earliest_wins(tokenizer, stop):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", stop=stop), None)
    steps = run(processor, "r", tokenizer.encode("Hello world, everyone"))
    completion = outputs_of(steps)[-1].outputs[0]
    assert completion.text == "Hel"
    assert completion.stop_reason == ("lo wo" if stop == ["lo wo"] else "lo")


def test_eos_text_is_left_out_and_not_aborted(tokenizer):
    ids = tokenizer.encode("Hi there") + [2]
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", skip_special_tokens=False), None)
    steps = run(processor, "r", ids, finish_reason=FinishReason.STOP)
    completion = steps[-1].request_outputs[0].outputs[0]
    assert completion.text == "Hi there"
    assert completion.token_ids == ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert steps[-1].reqs_to_abort == []


@pytest.mark.parametrize("include", [False, True])
def test_delta_never_leaks_a_partial_stop_string(tokenizer, include):
    text = "a <EN b <E c <END> tail"
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer)
    common = dict(stop=["<END>"], include_stop_str_in_output=include)
    processor.add_request(make_request("d", output_kind=DELTA, **common), None)
    processor.add_request(make_request("c", output_kind=CUMULATIVE, **common), None)
    deltas, cumulative, decoded = [], [], []
    for step, token_id in enumerate(ids):
        result = processor.process_outputs(
            [EngineCoreOutput("d", [token_id]), EngineCoreOutput("c", [token_id])]
        )
        by_id = {ro.request_id: ro.outputs[0] for ro in result.request_outputs}
        if not by_id:
            break
        deltas.append(by_id["d"].text)
        cumulative.append(by_id["c"].text)
        decoded.append(tokenizer.decode(ids[: step + 1]))
    final = "a <EN b <E c <END>" if include else "a <EN b <E c "
    assert "".join(deltas) == cumulative[-1] == final
    for i in range(len(deltas)):
        # What was streamed is never taken back: it is a prefix of the final text.
        assert final.startswith("".join(deltas[: i + 1]))
        assert cumulative[i] == "".join(deltas[: i + 1])
    if not include:
        # The holdback did hold something: after "a <EN", the "<" was not streamed yet.
        assert cumulative[2] == "a " and decoded[2] == "a <EN"
        assert cumulative[3] == "a <EN b"


def test_final_only_emits_once(tokenizer):
    ids = tokenizer.encode("One two three four")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", output_kind=FINAL_ONLY, stop=["three"]), None)
    steps = run(processor, "r", ids)
    outputs = outputs_of(steps)
    assert len(outputs) == 1
    assert outputs[0].outputs[0].text == "One two "
    assert steps[2].request_outputs == outputs


def test_detokenize_false_gives_ids_only(tokenizer):
    ids = tokenizer.encode("no text")
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", detokenize=False, logprobs=0), None)
    lists = LogprobsLists([[ids[0]]], [[-0.5]], [1])
    processor.process_outputs([EngineCoreOutput("r", ids[:1], new_logprobs=lists)])
    result = processor.process_outputs(step_outputs("r", ids[1:]))
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "" and completion.token_ids == ids
    assert completion.logprobs[0] == {ids[0]: Logprob(-0.5, 1, None)}


def test_logprob_dicts(tokenizer):
    hello, world, comma = tokenizer.encode("Hello world,")
    lists = LogprobsLists(
        logprob_token_ids=[[world, hello, world, comma], [comma, comma, world, hello]],
        logprobs=[[-1.5, -0.2, -1.5, -3.0], [-0.1, -0.1, -2.5, -4.0]],
        sampled_token_ranks=[2, 1],
    )
    positions = make_position_logprobs(lists, 2, lambda t: tokenizer.decode([t], False))
    assert positions[0] == {
        world: Logprob(-1.5, 2, " world"),
        hello: Logprob(-0.2, 1, "Hello"),
    }
    assert list(positions[0]) == [world, hello]  # the sampled token first
    assert positions[1] == {comma: Logprob(-0.1, 1, ","), world: Logprob(-2.5, 2, " world")}


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_logprobs_and_prompt_logprobs_in_outputs(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", logprobs=1, prompt_logprobs=0, output_kind=kind), None)
    prompt_lists = LogprobsLists([[4093], [198]], [[-3.0], [-0.5]], [7, 1])
    first = EngineCoreOutput(
        "r", [28], LogprobsLists([[28, 30]], [[-1.0, -0.5]], [2]), prompt_lists
    )
    second = EngineCoreOutput(
        "r", [2], LogprobsLists([[2, 2]], [[-0.25, -0.25]], [1]), None, FinishReason.STOP
    )
    out1 = processor.process_outputs([first]).request_outputs[0]
    out2 = processor.process_outputs([second]).request_outputs[0]
    expected_prompt = [None, {4093: Logprob(-3.0, 7, "user")}, {198: Logprob(-0.5, 1, "\n")}]
    assert out1.prompt_logprobs == expected_prompt
    assert out2.prompt_logprobs == (None if kind == DELTA else expected_prompt)
    assert out1.outputs[0].logprobs == [{28: Logprob(-1.0, 2, ","), 30: Logprob(-0.5, 1, ".")}]
    assert out1.outputs[0].cumulative_logprob == -1.0
    last = {2: Logprob(-0.25, 1, "<|im_end|>")}
    assert out2.outputs[0].logprobs == (
        [last] if kind == DELTA else out1.outputs[0].logprobs + [last]
    )
    assert out2.outputs[0].cumulative_logprob == -1.25


def make_children(processor, n, kind, seed=None, **params):
    request = make_request("p", n=n, output_kind=kind, seed=seed, **params)
    parent = ParentRequest("p", request.sampling_params)
    children = fan_out(request)
    for index, child in enumerate(children):
        processor.add_request(child, "prompt", parent, index)
    return children


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_n_children_are_gathered_into_one_output(tokenizer, kind):
    texts = ["first answer", "the second, longer answer", "3rd"]
    processor = OutputProcessor(tokenizer)
    children = make_children(processor, 3, kind, seed=10)
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in children)
    ids = [tokenizer.encode(t) for t in texts]
    streams = [step_outputs(c.request_id, i) for c, i in zip(children, ids, strict=True)]
    outputs = []
    for step in range(max(len(s) for s in streams)):
        # Children in reverse order: the parent output still lists them by index.
        batch = [s[step] for s in reversed(streams) if step < len(s)]
        result = processor.process_outputs(batch)
        assert len(result.request_outputs) <= 1
        outputs += result.request_outputs
    assert all(o.request_id == "p" for o in outputs)
    assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
    assert not processor.has_unfinished_requests() and not processor.parent_requests
    if kind == FINAL_ONLY:
        assert len(outputs) == 1
    if kind == DELTA:
        for o in outputs:
            assert [c.index for c in o.outputs] == sorted(c.index for c in o.outputs)
        got = [
            "".join(c.text for o in outputs for c in o.outputs if c.index == i) for i in range(3)
        ]
    else:
        assert all([c.index for c in o.outputs] == [0, 1, 2] for o in outputs)
        got = [c.text for c in outputs[-1].outputs]
    assert got == texts
    assert outputs[-1].metrics.num_generation_tokens == sum(len(i) for i in ids)


def test_abort_parent_aborts_its_children(tokenizer):
    processor = OutputProcessor(tokenizer)
    make_children(processor, 2, CUMULATIVE)
    processor.add_request(make_request("other"), None)
    assert processor.abort_requests(["p", "missing"]) == ["0_p", "1_p"]
    assert processor.get_num_unfinished_requests() == 1 and not processor.parent_requests
    assert processor.process_outputs([EngineCoreOutput("0_p", [5])]).request_outputs == []
    with pytest.raises(ValueError, match="request_id 'other'"):
        processor.add_request(make_request("other"), None)


def test_iteration_stats(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("a", arrival_time=100.0), None)
    processor.add_request(make_request("b", arrival_time=100.5), None)
    s1 = processor.process_outputs([EngineCoreOutput("a", [5, 6])], now=101.0).iteration_stats
    assert s1.time_to_first_tokens == [1.0] and s1.inter_token_latencies == []
    assert (s1.num_prompt_tokens, s1.num_generation_tokens) == (3, 2)
    s2 = processor.process_outputs(
        [EngineCoreOutput("a", [7], finish_reason=FinishReason.LENGTH), EngineCoreOutput("b", [8])],
        now=101.25,
    ).iteration_stats
    assert s2.time_to_first_tokens == [0.75] and s2.inter_token_latencies == [0.25]
    assert (s2.num_prompt_tokens, s2.num_generation_tokens) == (3, 2)
    (finished,) = s2.finished_requests
    assert finished.request_id == "a" and finished.finish_reason == FinishReason.LENGTH
    assert finished.e2e_latency == 1.25 and finished.num_generation_tokens == 3
    assert finished.time_to_first_token == 1.0 and finished.mean_inter_token_latency == 0.125


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_abort_output_ends_each_unfinished_completion_with_abort(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", output_kind=kind), "prompt")
    ids = tokenizer.encode(" so far")
    sent = outputs_of(run(processor, "r", ids, finish_reason=None))
    aborted = processor.make_abort_output("r")
    assert (aborted.request_id, aborted.prompt, aborted.finished) == ("r", "prompt", True)
    assert aborted.prompt_token_ids == PROMPT_IDS
    [completion] = aborted.outputs
    assert completion.finish_reason == "abort"
    # DELTA: nothing new; CUMULATIVE: as last sent; FINAL_ONLY sent nothing.
    expected = (" so far", ids) if kind == CUMULATIVE else ("", [])
    assert (completion.text, completion.token_ids) == expected
    assert len(sent) == (0 if kind == FINAL_ONLY else len(ids))
    processor.abort_requests(["r"])
    assert processor.make_abort_output("r") is None


def test_abort_output_of_a_parent_lists_its_unfinished_children(tokenizer):
    processor = OutputProcessor(tokenizer)
    make_children(processor, 3, CUMULATIVE)
    processor.process_outputs(step_outputs("1_p", tokenizer.encode(" done")))
    processor.process_outputs(step_outputs("2_p", tokenizer.encode(" half"), finish_reason=None))
    aborted = processor.make_abort_output("p")
    assert [(c.index, c.text, c.finish_reason) for c in aborted.outputs] == [
        (0, "", "abort"),
        (2, " half", "abort"),
    ]


def test_pooling_output_carries_its_vector_and_counts_its_prompt(tokenizer):
    """A pooling request's one output: no token, its vector in ``pooled``, finished; its prompt
    tokens count in the iteration's prompt tokens (no first token would count them)."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=1, detokenize=False, output_kind=FINAL_ONLY)
    processor.add_request(EngineCoreRequest("p", PROMPT_IDS, params, 2, 0.0), None)
    vector = bytes(range(16))
    output = EngineCoreOutput("p", [], finish_reason=FinishReason.STOP, pooled=vector)
    processed = processor.process_outputs([output])
    (request_output,) = processed.request_outputs
    assert request_output.finished and request_output.pooled == vector
    assert request_output.outputs[0].token_ids == []
    assert processed.iteration_stats.num_prompt_tokens == len(PROMPT_IDS)
    assert not processor.has_unfinished_requests()
