"""Property tests of structured outputs: 120 generated JSON schemas, 40 regexes and 40 choice
lists, each sampled once through the offline ``LLM``; every output must parse and validate
(``jsonschema_rs``), fully match its regex, or be one of its choices.

The model is a tiny random one on the default model's tokenizer (the real vocabulary, so the
grammars' token masks are the real ones), sampled at temperature 1 with a seed per request: its
flat distribution walks the grammars' branches far more widely than a trained model would. All
requests go in one ``generate`` call.

Every schema is bounded (``maxLength``, ``maxItems``, integer ranges, ``enum`` / pattern strings,
no additional properties, ``disable_any_whitespace``), so each output is complete well within
``max_tokens``: a truncated output (finish reason ``length``) is a failure. Numbers are
integers for the same reason: a JSON ``number`` may have any number of fraction digits, and a
random model rarely stops writing them.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema_rs
import pytest

from kiln import LLM
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.testing.models import save_tiny_model
from kiln.tokenizer import load_tokenizer

NUM_SCHEMAS = 120
NUM_REGEXES = 40
NUM_CHOICES = 40
MAX_TOKENS = 400

PATTERNS = [
    "^[a-z]{1,6}$",
    "^[A-Z][0-9]{2}$",
    "^(red|green|blue)$",
    "^[0-9]{3}-[0-9]{2}$",
    "^x{1,5}y?$",
]
WORDS = ["a", "b c", "Ünïcode", 'quo"te', "back\\slash", "new\nline", "ta\tb", "é", "{}", "42"]


def make_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random bounded JSON schema: nested objects and arrays, enums, integer bounds, string
    lengths and patterns."""
    kinds = ["string", "pattern", "enum", "integer", "boolean", "null"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
        values += rng.sample([0, 1, -7, True, None], rng.randint(0, 2))
        return {"enum": values}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        low = rng.randint(0, 2)
        items = make_schema(rng, depth + 1)
        return {
            "type": "array",
            "items": items,
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    names = rng.sample(
        ["id", "name", "tags", "size", "inner", "ok", "k-ey", "ü"], rng.randint(1, 4)
    )
    properties = {name: make_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def make_regex(rng: random.Random) -> str:
    """A random regex of classes, literals, alternations and bounded repeats."""
    parts = []
    for _ in range(rng.randint(1, 4)):
        atom = rng.choice(
            ["[a-z]", "[0-9]", "[A-F0-9]", "(ab|cd|e)", "x", r"\.", "-", "[ _]", "(yes|no)"]
        )
        low = rng.randint(0, 2)
        parts.append(f"{atom}{{{low},{low + rng.randint(0, 3)}}}")
    return "".join(parts)


def make_choices(rng: random.Random) -> list[str]:
    return rng.sample(WORDS + ["yes", "no", "maybe", "a b", "ab", "abc"], rng.randint(1, 5))


@pytest.fixture(scope="module")
def tiny_llm(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    hf_tokenizer = load_tokenizer(gguf_path).hf_tokenizer
    folder = save_tiny_model(
        tmp_path_factory.mktemp("tiny_smollm2_vocab"),
        tokenizer=hf_tokenizer,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        max_position_embeddings=1024,
    )
    return LLM(folder, dtype="float32", kv_cache_memory=0.25, max_model_len=512, max_num_seqs=64)


def _params(seed: int, **spec: Any) -> SamplingParams:
    structured = StructuredOutputsParams(**spec)
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=structured
    )


def test_generated_schemas_regexes_and_choices_always_hold(tiny_llm: LLM) -> None:
    rng = random.Random(12)
    schemas = [make_schema(rng) for _ in range(NUM_SCHEMAS)]
    regexes = [make_regex(rng) for _ in range(NUM_REGEXES)]
    choices = [make_choices(rng) for _ in range(NUM_CHOICES)]
    params = [_params(i, json=s, disable_any_whitespace=True) for i, s in enumerate(schemas)]
    params += [_params(1000 + i, regex=r) for i, r in enumerate(regexes)]
    params += [_params(2000 + i, choice=c) for i, c in enumerate(choices)]
    prompts = [f"Item {i}:" for i in range(len(params))]
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)

    failures = []
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        text = completion.text
        if completion.finish_reason != "stop":
            failures.append((i, f"finish_reason {completion.finish_reason}", text))
            continue
        if i < NUM_SCHEMAS:
            schema = schemas[i]
            try:
                jsonschema_rs.validate(schema, json.loads(text))
            except (ValueError, jsonschema_rs.ValidationError) as exc:
                failures.append((i, f"{json.dumps(schema)}: {exc}", text))
        elif i < NUM_SCHEMAS + NUM_REGEXES:
            if not re.fullmatch(regexes[i - NUM_SCHEMAS], text):
                failures.append((i, regexes[i - NUM_SCHEMAS], text))
        elif text not in choices[i - NUM_SCHEMAS - NUM_REGEXES]:
            failures.append((i, choices[i - NUM_SCHEMAS - NUM_REGEXES], text))
    assert not failures, (
        f"{len(failures)} of {len(outputs)} outputs broke their spec: {failures[:5]}"
    )
    # The generator covers what the issue names: nesting, arrays, enums, bounds, patterns.
    dumped = json.dumps(schemas)
    for word in ('"properties"', '"items"', '"enum"', '"minimum"', '"maxLength"', '"pattern"'):
        assert dumped.count(word) >= 10, word
