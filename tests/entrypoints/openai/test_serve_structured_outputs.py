"""Structured outputs over HTTP with the official ``openai`` client: ``response_format``
(``json_schema`` and ``json_object``) and vLLM's ``structured_outputs`` field are enforced while
sampling; a spec the grammar engine cannot read is a 400 before any byte is streamed."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from kiln.testing.server import KilnServer

SELF_REQUIRING = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
"""A JSON schema whose every object needs another inside it: no finite JSON satisfies it."""


class Country(BaseModel):
    name: str = Field(max_length=30)
    capital: str = Field(max_length=30)
    population_millions: int


def test_parse_with_a_pydantic_model_returns_the_parsed_object(
    client: openai.OpenAI, model_name: str
) -> None:
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Give the name and capital of France."}],
        response_format=Country,
        temperature=0,
        max_completion_tokens=120,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Country)
    assert message.parsed == Country.model_validate_json(message.content)


def test_json_object_output_parses(client: openai.OpenAI, model_name: str) -> None:
    completion = client.chat.completions.create(
        model=model_name,
        messages=[
            {
                "role": "user",
                "content": 'Give a JSON object with the keys "animal" and "sound" for a cat.',
            }
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_completion_tokens=200,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_regex_and_choice_are_obeyed_for_n2_with_sampling(
    client: openai.OpenAI, model_name: str, endpoint: str
) -> None:
    cases = [({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, r"[A-Z][a-z]{2,8} [0-9]{1,3}")]
    cases.append(({"choice": ["red", "green", "blue"]}, "red|green|blue"))
    for spec, pattern in cases:
        kwargs = {
            "model": model_name,
            "n": 2,
            "temperature": 1.2,
            "seed": 1,
            "extra_body": {"structured_outputs": spec},
        }
        if endpoint == "completions":
            response = client.completions.create(
                prompt="Name a colour or a street:", max_tokens=20, **kwargs
            )
            texts = [choice.text for choice in response.choices]
        else:
            response = client.chat.completions.create(
                messages=[{"role": "user", "content": "Name a colour or a street."}],
                max_completion_tokens=20,
                **kwargs,
            )
            texts = [choice.message.content for choice in response.choices]
        assert [choice.finish_reason for choice in response.choices] == ["stop", "stop"], texts
        for text in texts:
            assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                    },
                }
            },
            "strin",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"regex": "a+("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        # Issue 26 item 6: grammars no finite output satisfies (on main: 200 with empty text).
        ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": 'root ::= "a" x\nx ::= "b" x'}}, "never ends"),
        ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SELF_REQUIRING},
                }
            },
            "structured_outputs.json",
        ),
    ],
)
def test_a_bad_spec_is_a_400_before_streaming(http: httpx.Client, body: dict, named: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        response = http.post(
            "/v1/chat/completions", json={"messages": messages, "stream": stream, **body}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert named in error["message"], error


def test_a_complete_grammar_stops_the_request_despite_ignore_eos(
    client: openai.OpenAI, model_name: str, server: KilnServer
) -> None:
    """Issue 26 item 6: with ``ignore_eos`` the tokens after a complete grammar were appended
    ("yes\nsystem...") with an error logged for each; now the request stops there."""
    before = server.output().count("not allowed by its grammar")
    completion = client.completions.create(
        model=model_name,
        prompt="Is the sky blue? Answer:",
        max_tokens=24,
        extra_body={"structured_outputs": {"choice": ["yes"]}, "ignore_eos": True},
    )
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason) == ("yes", "stop")
    assert completion.usage is not None and completion.usage.completion_tokens < 24
    assert server.output().count("not allowed by its grammar") == before
