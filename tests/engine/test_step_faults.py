"""Fault injection into each shared stage of an engine step (scheduling, the model runner's
forward, sampling, applying the outputs), on a real offline engine of a tiny random model: the
failing ``generate`` raises ``EngineDeadError`` from the injected error, and every later call
does too, instead of running on with requests in an unknown state. (Errors of one request fail
that request only: ``tests/structured_output/test_grammar_fault_isolation.py``, the LoRA tests.)
"""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.messages import EngineDeadError
from kiln.testing.models import save_tiny_model

STAGES = {
    "schedule": lambda core: core.scheduler,
    "execute_model": lambda core: core.executor.worker.model_runner,
    "forward": lambda core: core.executor.worker.model_runner.sampler,
    "update_from_output": lambda core: core.scheduler,
}
"""Method -> the engine core's object that runs it (the scheduler, the model runner, the
sampler: whichever classes the platform chose, patched on the live object)."""
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("faults") / "tiny", seed=3)


@pytest.mark.parametrize("method", list(STAGES))
def test_a_failing_stage_kills_the_engine_clearly(
    tiny_model: str, gguf_path: str, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    llm = LLM(tiny_model, tokenizer=gguf_path, dtype="float32", kv_cache_memory=0.05)
    try:
        assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids

        def fail(*args, **kwargs):
            raise RuntimeError(f"injected fault in {method}")

        monkeypatch.setattr(STAGES[method](llm.llm_engine.engine_core), method, fail)
        with pytest.raises(EngineDeadError, match=f"injected fault in {method}") as info:
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
        assert isinstance(info.value.__cause__, RuntimeError)
        monkeypatch.undo()
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            llm.generate([[8, 9]], PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
