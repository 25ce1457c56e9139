"""The input processor: tokenization with the model's BOS policy, validation, EOS, fan-out."""

import time

import pytest

from kiln.engine.input_processor import (
    InputProcessor,
    PromptError,
    child_request_id,
    fan_out,
    make_child_params,
    prompt_text,
)
from kiln.model_executor.loader.default_model import default_model_path
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer, load_tokenizer

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture
def processor(tokenizer):
    return InputProcessor(tokenizer, MAX_MODEL_LEN, max_logprobs=5, eos_token_id=2)


def test_text_prompt_uses_the_models_bos_policy(tokenizer):
    bos_tokenizer = Tokenizer(tokenizer.hf_tokenizer, add_bos=True)
    bos = bos_tokenizer.bos_token_id
    for tok, expected in ((tokenizer, []), (bos_tokenizer, [bos])):
        processor = InputProcessor(tok, MAX_MODEL_LEN, 5, 2)
        ids = tokenizer.encode("Hello world", add_special_tokens=False)
        assert processor.process("r", "Hello world", SamplingParams()).prompt_token_ids == [
            *expected,
            *ids,
        ]
        assert (
            processor.process("r", {"prompt": "Hello world"}, SamplingParams()).prompt_token_ids[
                len(expected) :
            ]
            == ids
        )


def test_token_id_prompts_are_used_exactly(tokenizer):
    processor = InputProcessor(Tokenizer(tokenizer.hf_tokenizer, add_bos=True), 32, 5, 2)
    ids = [19556, 905, 2]
    assert processor.process("r", ids, SamplingParams()).prompt_token_ids == ids
    both = {"prompt_token_ids": ids, "prompt": "ignored for tokenization"}
    assert processor.process("r", both, SamplingParams()).prompt_token_ids == ids
    assert prompt_text(both) == "ignored for tokenization"
    assert prompt_text(ids) is None and prompt_text("x") == "x"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "must be provided and non-empty"),
        ([], "must be provided and non-empty"),
        ({"prompt_token_ids": []}, "must be provided and non-empty"),
        ({"prompt": "", "prompt_token_ids": []}, "must be provided and non-empty"),
        (
            [5, 49152],
            r"token id 49152 at position 1 of prompt is out of vocabulary \(vocab_size=49152\)",
        ),
        ([-1], "token id -1 at position 0 of prompt must be greater than or equal to 0"),
        ([1.5], "token id 1.5 at position 0 of prompt must be an integer"),
        ({"text": "hi"}, "'prompt' or a 'prompt_token_ids' key"),
        (42, "prompt must be a string"),
    ],
)
def test_bad_prompts_are_rejected(processor, prompt, field):
    with pytest.raises(ValueError, match=field):
        processor.process("r", prompt, SamplingParams())


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}])
def test_the_empty_prompt_rule_lives_here_in_vllm_wording(processor, prompt):
    # The server has no check of its own: this error is its 400, message and param unchanged.
    with pytest.raises(PromptError) as error:
        processor.process("r", prompt, SamplingParams())
    assert str(error.value) == "Either prompt or prompt_embeds must be provided and non-empty."
    assert error.value.param == "prompt"


def test_context_length_errors_use_vllm_wording_and_name_the_field(processor):
    prompt = list(range(10, 30))  # 20 tokens
    with pytest.raises(PromptError) as error:
        processor.process("r", prompt, SamplingParams(max_tokens=13))
    assert str(error.value) == (
        "'max_tokens' or 'max_completion_tokens' is too large: 13. This model's maximum context "
        "length is 32 tokens and your request has 20 input tokens (13 > 32 - 20)."
    )
    assert error.value.param == "max_tokens"
    request = processor.process("r", prompt, SamplingParams(max_tokens=12))
    assert request.sampling_params.max_tokens == 12
    # A prompt longer than the context, and one that leaves no room for a token.
    for num_tokens, max_tokens in ((40, 1), (32, None)):
        with pytest.raises(PromptError) as error:
            processor.process(
                "r", list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=max_tokens)
            )
        assert str(error.value) == (
            f"This model's maximum context length is 32 tokens. However, your request has "
            f"{num_tokens} input tokens. Please reduce the length of the input messages."
        )
        assert error.value.param == "prompt"


def test_prompt_name_names_the_prompt_in_token_id_errors(processor):
    with pytest.raises(PromptError, match="at position 0 of prompt 3 must be greater") as error:
        processor.process("r", [-4], SamplingParams(), prompt_name="prompt 3")
    assert error.value.param == "prompt"
    with pytest.raises(PromptError, match="token id 7 at position 0 of tokens"):
        InputProcessor(None, 32, 5, None, vocab_size=7).check_token_ids([7], "tokens")


def test_max_tokens_none_fills_the_context_without_mutating_the_callers_params(processor):
    params = SamplingParams(max_tokens=None)
    request = processor.process("r", list(range(10, 30)), params)
    assert request.sampling_params.max_tokens == 12
    assert params.max_tokens is None
    assert request.sampling_params is not params


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_too_many_logprobs(processor, field):
    assert processor.process("r", [5], SamplingParams(**{field: 5})).sampling_params
    with pytest.raises(ValueError, match=f"^{field} must be <= max_logprobs \\(5\\), got 6"):
        processor.process("r", [5], SamplingParams(**{field: 6}))


def test_token_ids_in_params_are_checked(processor):
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process("r", [5], SamplingParams(stop_token_ids=[60000]))
    with pytest.raises(ValueError, match="logit_bias"):
        processor.process("r", [5], SamplingParams(logit_bias={60000: 1.0}))


def test_priority_needs_the_priority_policy(tokenizer, processor):
    with pytest.raises(ValueError, match="^priority 3 needs priority scheduling"):
        processor.process("r", [5], SamplingParams(), priority=3)
    assert processor.process("r", [5], SamplingParams(), priority=0).priority == 0
    by_priority = InputProcessor(tokenizer, MAX_MODEL_LEN, 5, 2, scheduling_policy="priority")
    assert by_priority.process("r", [5], SamplingParams(), priority=-3).priority == -3


def test_eos_and_generation_config(tokenizer):
    processor = InputProcessor(tokenizer, MAX_MODEL_LEN, 5, 2, scheduling_policy="priority")
    request = processor.process("r", [5], SamplingParams(), arrival_time=12.5, priority=3)
    assert request.eos_token_id == 2
    assert 2 in request.sampling_params.all_stop_token_ids
    assert (request.arrival_time, request.priority, request.request_id) == (12.5, 3, "r")
    assert processor.process("r", [5], SamplingParams(ignore_eos=True)).eos_token_id is None
    before = time.time()
    assert before <= processor.process("r", [5], SamplingParams()).arrival_time <= time.time()
    # Extra EOS ids of a generation config stop generation unless ignore_eos.
    processor = InputProcessor(tokenizer, 32, 5, 2, generation_config={"eos_token_id": [2, 7]})
    params = processor.process("r", [5], SamplingParams(stop_token_ids=[9])).sampling_params
    assert params.stop_token_ids == [7, 9]
    assert params.all_stop_token_ids == {2, 7, 9}
    params = processor.process("r", [5], SamplingParams(ignore_eos=True)).sampling_params
    assert params.stop_token_ids == [] and params.all_stop_token_ids == {2, 7}


def test_text_prompt_without_tokenizer_is_rejected():
    processor = InputProcessor(None, 32, 5, None, vocab_size=100)
    assert processor.process("r", [99], SamplingParams()).prompt_token_ids == [99]
    with pytest.raises(ValueError, match="prompt must be token ids"):
        processor.process("r", "text", SamplingParams())


def test_fan_out(processor):
    request = processor.process("req", [5, 6], SamplingParams(n=3, seed=41))
    children = fan_out(request)
    assert [c.request_id for c in children] == [child_request_id("req", i) for i in range(3)]
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.seed for c in children] == [41, 42, 43]
    assert all(c.sampling_params.n == 1 and c.prompt_token_ids == [5, 6] for c in children)
    assert request.sampling_params.n == 3 and request.sampling_params.seed == 41
    unseeded = processor.process("u", [5], SamplingParams(n=2))
    assert [c.sampling_params.seed for c in fan_out(unseeded)] == [None, None]
    single = processor.process("s", [5], SamplingParams())
    assert fan_out(single) == [single]
    # The prompt is the same for every child: only child 0 computes its logprobs.
    echoed = processor.process("e", [5, 6], SamplingParams(n=3, prompt_logprobs=2))
    assert [c.sampling_params.prompt_logprobs for c in fan_out(echoed)] == [2, None, None]
    assert make_child_params(SamplingParams(seed=2**64 - 1), 1).seed == 0


def test_vocabulary_fields(tokenizer, processor):
    """allowed_token_ids must be in the vocabulary; bad_words are tokenized (as written and after
    a space); truncate_prompt_tokens keeps the prompt's last tokens."""
    with pytest.raises(ValueError, match="^allowed_token_ids must be token ids in"):
        processor.process("r", [5], SamplingParams(allowed_token_ids=[7, 60000]))
    request = processor.process("r", [5], SamplingParams(bad_words=["hello"]))
    expected = [tokenizer.encode(t, add_special_tokens=False) for t in ("hello", " hello")]
    assert request.sampling_params.bad_words_token_ids == expected
    request = processor.process("r", list(range(5, 15)), SamplingParams(truncate_prompt_tokens=3))
    assert request.prompt_token_ids == [12, 13, 14]
    with pytest.raises(ValueError, match="^bad_words need a tokenizer"):
        InputProcessor(None, 32, 5, None, vocab_size=100).process(
            "r", [5], SamplingParams(bad_words=["x"])
        )
