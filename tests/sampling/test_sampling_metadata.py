"""SamplingMetadata.from_params: batched values, flags and sparse per-row data."""

import pytest
import torch

from kiln.sampling import SamplingMetadata, make_generator
from kiln.sampling_params import SamplingParams

V = 10


def build(params, outputs=None, prompts=None, generators=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_params(params, outputs, prompts, generators or {}, V, "cpu")


def test_per_row_values_in_batch_order():
    md = build(
        [
            SamplingParams(temperature=0.5, top_p=0.9, top_k=3, min_p=0.1),
            SamplingParams(temperature=0.0, top_k=4),
            SamplingParams(top_k=50, presence_penalty=0.5, frequency_penalty=-1.0),
        ]
    )
    assert md.num_reqs == 3
    assert md.temperature.tolist() == [0.5, 0.0, 1.0]
    assert md.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
    # The greedy row's top_k was reset; top_k > V is off too.
    assert md.top_k.tolist() == [3, V, V]
    assert md.top_k.dtype == torch.int64
    assert md.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert md.presence_penalties.tolist() == [0.0, 0.0, 0.5]
    assert md.frequency_penalties.tolist() == [0.0, 0.0, -1.0]
    assert md.repetition_penalties.tolist() == [1.0, 1.0, 1.0]
    assert (md.all_greedy, md.all_random) == (False, False)
    assert (md.no_top_k, md.no_top_p, md.no_min_p, md.no_penalties) == (False, False, False, False)
    assert md.max_top_k == 3
    assert not md.all_random_top_k  # row 2 is random without top-k
    assert md.prompt_token_ids is None  # no repetition penalty: the prompt is not needed
    assert md.logit_bias is None and md.min_tokens == {} and md.max_num_logprobs is None


def test_flags_when_nothing_is_used():
    md = build([SamplingParams(temperature=0), SamplingParams(temperature=0, top_p=0.3)])
    assert md.all_greedy and not md.all_random
    assert md.no_top_k and md.no_top_p and md.no_min_p and md.no_penalties
    assert md.max_top_k == 0
    assert not md.all_random_top_k
    md = build([SamplingParams(), SamplingParams(seed=1)])
    assert md.all_random and not md.all_greedy
    md = build([SamplingParams(top_k=4, top_p=0.5), SamplingParams(temperature=0)])
    assert md.all_random_top_k and md.max_top_k == 4  # greedy rows don't count


def test_repetition_penalty_builds_padded_prompt():
    md = build(
        [SamplingParams(repetition_penalty=1.2), SamplingParams()],
        prompts=[[1, 2, 3], [4]],
    )
    assert not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[1, 2, 3], [4, V, V]]
    with pytest.raises(ValueError, match="prompt_token_ids is required"):
        build([SamplingParams(repetition_penalty=1.2)])


def test_sparse_rows():
    eos = SamplingParams(min_tokens=2, stop_token_ids=[7], logprobs=2)
    eos.update_from_generation_config({}, model_eos_token_id=1)
    done = SamplingParams(min_tokens=1, stop_token_ids=[7], logprobs=5)
    gen = make_generator(3, "cpu")
    md = build(
        [eos, SamplingParams(logit_bias={2: 1.0}), done],
        outputs=[[5], [], [6]],
        generators={1: gen},
    )
    assert md.min_tokens == {0: (2, {1, 7})}  # row 2 already has its min_tokens
    assert md.logit_bias == [None, {2: 1.0}, None]
    assert md.max_num_logprobs == 5
    assert md.generators == {1: gen}


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 10\), got 10"):
        build([SamplingParams(logit_bias={10: 1.0})])
    with pytest.raises(ValueError, match="output_token_ids must have one list per request"):
        SamplingMetadata.from_params([SamplingParams()], [], None, {}, V, "cpu")
