"""``--speculative-config`` (vLLM's JSON, ValueErrors naming the field) and the ngram proposer's
lookup, on hand-made token sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.config import SpeculativeConfig, parse_speculative_config
from kiln.engine.arg_utils import EngineArgs
from kiln.spec_decode.interface import ProposalInputs
from kiln.spec_decode.ngram import NgramProposer, ngram_draft


def test_flag_and_keyword_make_the_section() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    config = EngineArgs(speculative_config=json.dumps(spec)).create_config()
    assert config.speculative == SpeculativeConfig("ngram", 3, 4, 4)  # min takes max's value
    config = EngineArgs.from_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    ).create_config()
    assert config.speculative == SpeculativeConfig("ngram", 2, 5, 5)  # vLLM's defaults
    # A model without a method is a draft model, as vLLM infers it.
    config = EngineArgs.from_kwargs(
        speculative_config={"model": "draft.gguf", "num_speculative_tokens": 3}
    ).create_config()
    assert (config.speculative.method, config.speculative.model) == ("draft_model", "draft.gguf")
    assert config.speculative.num_lookahead_tokens == 3  # the draft's KV slots
    assert EngineArgs().create_config().speculative.method is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative.method='medusa'"),
        ('{"method": "ngram"}', "speculative.num_speculative_tokens=0"),
        ('{"method": "ngram", "num_speculative_tokens": -1}', "an integer in [1, 32]"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', "an integer in [1, 32]"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative.model=None"),
        ('{"model": "d.gguf"}', "speculative.num_speculative_tokens=0"),
        (
            '{"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 2}',
            "speculative.model='d.gguf' is invalid; allowed: a GGUF file or Hugging Face folder "
            "with method 'draft_model'",
        ),
        (
            '{"model": "d.gguf", "num_speculative_tokens": 2, "quantization": "fp8"}',
            "speculative.quantization='fp8'",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
            "speculative.prompt_lookup_min=0",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "at most prompt_lookup_max",
        ),
        ('{"num_speculative_tokens": 2}', "0 without a method"),
        ('{"method": "ngram", "k": 2}', "keys in ['method', 'num_speculative_tokens'"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_values_name_the_field(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        EngineArgs(speculative_config=value).create_config()


def test_parse_leaves_no_speculation_alone() -> None:
    assert parse_speculative_config(None) == {}
    assert parse_speculative_config("") == {}


def draft(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    return ngram_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_takes_the_longest_suffix_then_the_latest_occurrence() -> None:
    # Suffix [2, 3] occurs at 1..2 (followed by 9, 9) and [3] alone at 5 (followed by 7): the
    # longer match wins.
    assert draft([1, 2, 3, 9, 9, 3, 7, 2, 3]) == [9, 9, 3]
    # Two occurrences of the same length: the latest one.
    assert draft([5, 1, 4, 5, 2, 6, 5], max_n=1) == [2, 6, 5]
    # k cuts the draft; the end of the sequence cuts it too.
    assert draft([1, 2, 3, 1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    assert draft([7, 8, 7], k=5) == [8, 7]


def test_ngram_drafts_nothing_without_a_match_of_min_n() -> None:
    assert draft([1, 2, 3, 4]) == []
    assert draft([1, 2, 3, 9, 3], min_n=2) == []  # only [3] matches
    assert draft([4]) == []
    assert draft([1, 2, 3, 9, 2, 3], min_n=2) == [9, 2, 3]


def test_proposer_reads_rows_of_the_batch() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    config = EngineArgs.from_kwargs(speculative_config=spec).create_config()
    proposer = NgramProposer(config, device=None)  # type: ignore[arg-type]
    token_ids = np.zeros((3, 10), dtype=np.int64)
    token_ids[0, :5] = [1, 2, 3, 1, 2]
    token_ids[2, :4] = [4, 5, 6, 7]
    num_tokens = np.array([5, 0, 4])
    assert proposer.propose(ProposalInputs(token_ids, num_tokens, [2, 0])) == [[], [3, 1]]
