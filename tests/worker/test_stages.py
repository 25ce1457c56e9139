"""A feature of the runner's step is a stage (``kiln.worker.stages``): a stage added to a live
runner's ``stages`` hears of every request joining and leaving the batch and prepares every step
before its forward, where it may fail a request alone; a real offline engine of a tiny random
model, on the process's platform."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.messages import NewRequestData
from kiln.testing.models import save_tiny_model
from kiln.worker.model_runner import ModelRunner
from kiln.worker.stages import RunnerStage
from kiln.worker.step_plan import StepPlan

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class RecordingStage(RunnerStage):
    """Records its hooks; fails request ``fail_id`` in ``before_forward``."""

    def __init__(self, fail_id: str | None = None) -> None:
        self.added: list[str] = []
        self.removed: list[str] = []
        self.steps: list[list[str]] = []
        self.fail_id = fail_id

    def add_requests(self, new_reqs: list[NewRequestData]) -> None:
        self.added.extend(new.req_id for new in new_reqs)

    def remove_requests(self, req_ids: list[str]) -> None:
        self.removed.extend(req_ids)

    def before_forward(self, plan: StepPlan) -> None:
        self.steps.append(list(plan.req_ids))
        if self.fail_id in plan.req_ids:
            plan.failed_requests[self.fail_id] = "the recording stage refused it"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    tiny = save_tiny_model(tmp_path_factory.mktemp("stages") / "tiny", seed=5)
    llm = LLM(tiny, tokenizer=gguf_path, dtype="float32", kv_cache_memory=0.05)
    yield llm
    llm.llm_engine.shutdown()


def _add_stage(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner, stage: RunnerStage) -> None:
    stages = type(runner).stages
    monkeypatch.setattr(type(runner), "stages", property(lambda self: (*stages.fget(self), stage)))


def test_an_added_stage_sees_every_request_and_step(llm, monkeypatch) -> None:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    prompts = [[5, 6, 7], [8, 9]]
    before = llm.generate(prompts, PARAMS, use_tqdm=False)
    stage = RecordingStage()
    _add_stage(monkeypatch, runner, stage)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in before]
    first = list(stage.added)
    assert len(first) == 2
    assert len(stage.steps) == PARAMS.max_tokens  # one prefill step, then the decodes
    assert all(sorted(step) == sorted(first) for step in stage.steps)
    # The runner hears of finished requests with the next step's diff.
    llm.generate(prompts[:1], PARAMS, use_tqdm=False)
    assert set(first) <= set(stage.removed) and len(stage.added) == 3


def test_a_request_a_stage_fails_fails_alone(llm, monkeypatch) -> None:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    engine = llm.llm_engine
    stage = RecordingStage(fail_id="victim")
    _add_stage(monkeypatch, runner, stage)
    engine.add_request("victim", [5, 6, 7], PARAMS)
    engine.add_request("other", [8, 9], PARAMS)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    assert finished["victim"].finish_reason == "error"
    assert "the recording stage refused it" in finished["victim"].stop_reason
    assert len(finished["other"].token_ids) == PARAMS.max_tokens
