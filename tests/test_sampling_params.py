"""SamplingParams: defaults, normalisation, validation messages, serialisation."""

import pickle

import msgspec
import pytest

from kiln.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.seed is None
    assert p.sampling_type is SamplingType.RANDOM


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(7, 8), top_k=-1, logit_bias={"5": 2, 6: -1.5})
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 8]
    assert p.top_k == 0
    assert p.logit_bias == {5: 2.0, 6: -1.5}
    assert p.all_stop_token_ids == {7, 8}
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_sampling_type_and_greedy_reset():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2, seed=3)
    assert greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    kept = SamplingParams(temperature=0.7, top_p=0.5, top_k=5, min_p=0.2)
    assert (kept.top_p, kept.top_k, kept.min_p) == (0.5, 5, 0.2)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be 0 or -1 (off) or an integer >= 1, got -2"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"max_tokens": 0}, "max_tokens must be None or an integer >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens (10), got 20"),
        ({"logprobs": -1}, "logprobs must be None or an integer >= 0, got -1"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be None or an integer >= 0, got -2"),
        ({"logit_bias": {3: 101}}, "logit_bias[3] must be in [-100, 100], got 101"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings, got ''"),
        ({"stop_token_ids": [-5]}, "stop_token_ids must be token ids"),
        ({"seed": 2.0}, "seed must be None or an integer"),
        ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be None or 1 to"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be token ids"),
        ({"bad_words": ["ok", " "]}, "bad_words must be non-blank strings"),
        ({"bad_words": ["w"] * 257}, "bad_words must be None or a list of at most 256"),
        ({"bad_words": ["x" * 257]}, "bad_words must be non-blank strings of at most 256"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None, -1 or"),
        ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens must be None, -1 or"),
    ],
)
def test_validation_names_field_value_and_range(kwargs, needle):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert needle in str(excinfo.value)


def test_boundaries_are_accepted():
    SamplingParams(
        temperature=0,
        top_p=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, 1: 100},
        min_tokens=16,
        max_tokens=16,
        logprobs=0,
    )


def test_verify_max_logprobs():
    SamplingParams(logprobs=5, prompt_logprobs=5).verify_max_logprobs(5)
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(5\), got 6"):
        SamplingParams(logprobs=6).verify_max_logprobs(5)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= max_logprobs"):
        SamplingParams(prompt_logprobs=9).verify_max_logprobs(5)


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[10])
    p.update_from_generation_config({"eos_token_id": [2, 7]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 7, 10}
    assert sorted(p.stop_token_ids) == [7, 10]  # the model's own EOS is the scheduler's business
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": 7}, model_eos_token_id=2)
    assert ignoring.stop_token_ids == []
    assert ignoring.all_stop_token_ids == {2, 7}  # still masked by min_tokens


def test_serialisation_round_trips():
    p = SamplingParams(
        n=2,
        temperature=0.3,
        stop=["\n"],
        logit_bias={4: 1.0},
        seed=7,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    p.update_from_generation_config({}, model_eos_token_id=3)
    assert pickle.loads(pickle.dumps(p)) == p
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert decoded == p
    assert decoded.all_stop_token_ids == {3}
    assert decoded.output_kind is RequestOutputKind.FINAL_ONLY


def test_clone_is_independent():
    p = SamplingParams(stop=["a"])
    c = p.clone()
    c.stop.append("b")
    assert p.stop == ["a"]
