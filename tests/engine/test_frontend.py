"""The front end admits a request once: an ``EngineCoreRequest`` the input processor already made
is sent as it is, not validated and tokenized again."""

from kiln.config import KilnConfig
from kiln.engine.frontend import Frontend
from kiln.sampling_params import SamplingParams


def test_a_processed_request_is_sent_as_it_is():
    frontend = Frontend(KilnConfig(), max_model_len=64)
    request = frontend.input_processor.process("r", "Hello there", SamplingParams(max_tokens=4))
    # The params given beside it are not used: the request carries its own.
    [sent] = frontend.make_requests("r", request, SamplingParams(max_tokens=1000))
    assert sent is request
    assert frontend.output_processor.has_unfinished_requests()
    fanned = frontend.input_processor.process("p", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    children = frontend.make_requests("p", fanned, SamplingParams())
    assert [c.request_id for c in children] == ["0_p", "1_p"]
    assert all(c.prompt_token_ids is fanned.prompt_token_ids for c in children)
