"""Structured outputs through the offline ``LLM`` on the real default model: JSON schema, regex
and choice are obeyed (n > 1 with sampling too), logprobs see the mask, a preempted request stays
valid, and a spec the grammar engine cannot read is refused at admission."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from kiln import LLM
from kiln.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


def test_json_regex_and_choice_are_obeyed_with_sampling_and_n2(llm_f32: LLM):
    prompts = [
        "Describe a person as JSON.",
        "When did the first person land on the moon? Date:",
        "Is the sky green? Answer yes or no:",
    ]
    params = [
        SamplingParams(
            temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON)
        ),
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=3,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex=DATE),
        ),
        SamplingParams(
            n=2,
            temperature=1.5,
            seed=5,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        ),
    ]
    person, dates, answers = llm_f32.generate(prompts, params, use_tqdm=False)
    assert person.outputs[0].finish_reason == "stop", person.outputs[0].text
    jsonschema_rs.validate(PERSON, json.loads(person.outputs[0].text))
    for completion in dates.outputs:
        assert completion.finish_reason == "stop"
        assert re.fullmatch(DATE, completion.text), completion.text
    for completion in answers.outputs:
        assert completion.finish_reason == "stop"
        assert completion.text in ("yes", "no", "maybe")


def test_logprobs_see_only_allowed_tokens(llm_f32: LLM):
    tokenizer = llm_f32.get_tokenizer()
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        logprobs=20,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "London"]),
    )
    (output,) = llm_f32.generate(["The capital of France is"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text in ("Paris", "London")
    first = completion.logprobs[0]
    allowed = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    # Top 20 of a masked distribution: only the few first tokens of the two choices (at most
    # 11 prefixes) are finite, the rest are -inf.
    assert allowed and len(allowed) <= 11
    for token_id in allowed:
        piece = tokenizer.decode([token_id])
        assert "Paris".startswith(piece) or "London".startswith(piece), piece


def test_preemption_keeps_structured_outputs_valid(llm_f32: LLM):
    # 19 usable blocks of 16 tokens; 8 requests that each grow to 4 blocks cannot all fit.
    small = LLM(kv_cache_memory=20 * 16 * 46080 / 2**30, max_num_seqs=8, dtype="float32")
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{30}-[a-z]{20}"),
    )
    prompts = [f"Write digits then letters, number {i}: " * 3 for i in range(8)]
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.stats.totals.preemptions > 0
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert re.fullmatch(r"[0-9]{30}-[a-z]{20}", completion.text), completion.text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
        ({"regex": "a+("}, "structured_outputs.regex is invalid"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar is invalid"),
    ],
)
def test_a_spec_the_engine_cannot_read_is_refused_at_admission(llm_f32: LLM, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm_f32.generate(
            ["x"],
            SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
            use_tqdm=False,
        )


def test_min_tokens_yields_to_a_complete_grammar(llm_f32: LLM):
    params = SamplingParams(
        temperature=0,
        max_tokens=12,
        min_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    (output,) = llm_f32.generate(["Is water wet? Answer:"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text in ("yes", "no")
    assert completion.finish_reason == "stop"
