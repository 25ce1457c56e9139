"""StructuredOutputsParams: the form of a constraint is checked at construction, with the field."""

import msgspec
import pytest

from kiln.config import StructuredOutputsConfig
from kiln.messages import EngineCoreRequest
from kiln.sampling_params import (
    MAX_STRUCTURED_OUTPUT_CHARS,
    SamplingParams,
    StructuredOutputsParams,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object, got none"),
        ({"regex": "a+", "choice": ["a"]}, "exactly one of .* got regex, choice"),
        ({"json": "{not json"}, "structured_outputs.json must be a JSON schema"),
        ({"json": "[1, 2]"}, r"structured_outputs.json must be a JSON schema \(object\)"),
        ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must be a list of non-empty strings"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
        ({"json_object": 1}, "structured_outputs.json_object must be true"),
        ({"regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)}, "at most 131072 characters"),
    ],
)
def test_bad_forms_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_dict_in_sampling_params_and_unknown_keys():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match=r"structured_outputs keys must be in .*'schema'"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="structured_outputs must be None"):
        SamplingParams(structured_outputs="a+")


def test_key_is_canonical_for_json_and_survives_msgpack():
    as_text = StructuredOutputsParams(json='{"type": "object", "required": []}')
    as_dict = StructuredOutputsParams(json={"required": [], "type": "object"})
    assert as_text.key == as_dict.key
    assert as_text.key != StructuredOutputsParams(json={"type": "array"}).key
    request = EngineCoreRequest("r", [1], SamplingParams(structured_outputs=as_dict), None, 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs == as_dict
    assert decoded.sampling_params.clone().structured_outputs.kind == "json"


def test_json_options_beside_response_format_apply_to_its_grammar():
    from kiln.entrypoints.openai.protocol import ChatCompletionRequest

    fields = {"messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    request = ChatCompletionRequest(
        **fields,
        response_format=schema,
        structured_outputs={"disable_any_whitespace": True, "disable_additional_properties": True},
    )
    params = request.structured_outputs_params()
    assert params.json == {"type": "object"}
    assert params.disable_any_whitespace and params.disable_additional_properties
    both = ChatCompletionRequest(
        **fields, response_format=schema, structured_outputs={"regex": "a"}
    )
    with pytest.raises(ValueError, match="must not both constrain"):
        both.structured_outputs_params()
    bad = ChatCompletionRequest(
        **fields, response_format=schema, structured_outputs={"disable_any_whitespace": "yes"}
    )
    with pytest.raises(ValueError, match="disable_any_whitespace must be a boolean"):
        bad.structured_outputs_params()


def test_json_options_are_structured_outputs_config_fields():
    from kiln.config.structured_outputs import parse_structured_outputs_config

    parsed = parse_structured_outputs_config('{"disable_any_whitespace": true}')
    assert parsed == {"disable_any_whitespace": True}
    with pytest.raises(ValueError, match="structured_outputs.disable_additional_properties"):
        StructuredOutputsConfig(disable_additional_properties="no")
