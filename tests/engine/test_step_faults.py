"""Fault injection into each shared stage of an engine step (scheduling, the model runner's
forward, sampling, applying the outputs), on a real offline engine of a tiny random model: the
failing ``generate`` raises ``EngineDeadError`` from the injected error, and every later call
does too, instead of running on with requests in an unknown state. (Errors of one request fail
that request only: ``tests/structured_output/test_grammar_fault_isolation.py``, the LoRA tests.)
"""

from __future__ import annotations

import importlib

import pytest

from kiln import LLM, SamplingParams
from kiln.messages import EngineDeadError
from kiln.testing.models import save_tiny_model

STAGES = [
    ("kiln.scheduler.scheduler", "Scheduler", "schedule"),
    ("kiln.worker.model_runner", "ModelRunner", "execute_model"),
    ("kiln.sampling.sampler", "Sampler", "forward"),
    ("kiln.scheduler.scheduler", "Scheduler", "update_from_output"),
]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("faults") / "tiny", seed=3)


@pytest.mark.parametrize(("module", "cls", "method"), STAGES, ids=[s[2] for s in STAGES])
def test_a_failing_stage_kills_the_engine_clearly(
    tiny_model: str,
    gguf_path: str,
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    cls: str,
    method: str,
) -> None:
    llm = LLM(
        tiny_model, tokenizer=gguf_path, dtype="float32", kv_cache_memory=0.05, platform="cpu"
    )
    try:
        assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        target = getattr(importlib.import_module(module), cls)

        def fail(*args, **kwargs):
            raise RuntimeError(f"injected fault in {method}")

        monkeypatch.setattr(target, method, fail)
        with pytest.raises(EngineDeadError, match=f"injected fault in {method}") as info:
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
        assert isinstance(info.value.__cause__, RuntimeError)
        monkeypatch.undo()
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            llm.generate([[8, 9]], PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
