"""Failure isolation in the engine step, by fault injection: a grammar that raises (while the
scheduler fills its bitmask, or takes a sampled token) fails its own request with finish reason
"error" and a message naming ``structured_outputs``; the other requests of the step finish as they
would alone, and the engine goes on. Faults are injected by replacing one method of the xgrammar
matcher for the duration of a test (``monkeypatch``), on the shared real engine."""

from __future__ import annotations

import pytest

from kiln import LLM
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.structured_output import backends

PROMPTS = ["Is the sky green? Answer yes or no:", "The capital of France is"]
PLAIN = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CHOICE = SamplingParams(
    temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
)


def _raising(method):
    """``method`` of a matcher, raising instead of running."""

    def fail(self, *args, **kwargs):
        raise RuntimeError(f"injected grammar fault in {method.__name__}")

    return fail


@pytest.mark.parametrize("method", ["fill_bitmask", "accept_token"])
def test_a_grammar_that_raises_fails_only_its_request(
    llm_f32: LLM, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    (alone,) = llm_f32.generate(PROMPTS[1:], PLAIN, use_tqdm=False)
    fault = _raising(getattr(backends._XGrammarMatcher, method))
    monkeypatch.setattr(backends._XGrammarMatcher, method, fault)
    structured, plain = llm_f32.generate(PROMPTS, [CHOICE, PLAIN], use_tqdm=False)
    failed = structured.outputs[0]
    assert failed.finish_reason == "error", failed
    assert "structured_outputs" in failed.stop_reason and "injected" in failed.stop_reason
    assert plain.outputs[0].token_ids == alone.outputs[0].token_ids
    monkeypatch.undo()
    (again,) = llm_f32.generate(PROMPTS[:1], CHOICE, use_tqdm=False)
    assert again.outputs[0].finish_reason == "stop" and again.outputs[0].text in ("yes", "no")
