"""StructuredOutputsParams: the form of a constraint is checked at construction, with the field."""

import msgspec
import pytest

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
