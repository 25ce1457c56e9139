"""Pooling requests in the scheduler, with hand-made runner outputs: prefilled in chunks of the
token budget, never decoded, finished (stopped, no token) in the step that computes their last
prompt token, with the runner's vector; their blocks are freed then."""

from __future__ import annotations

from kiln.messages import FinishReason, ModelRunnerOutput
from kiln.pooling_params import PoolingParams
from kiln.testing.scheduler import make_request, make_scheduler


def _runner_output(scheduler_output, pooled: dict[str, bytes]) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
        pooler_output=pooled,
    )


def test_pooling_request_is_chunked_and_finishes_after_its_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("p", 20, max_tokens=1)
    request.pooling_params = PoolingParams()
    scheduler.add_request(request)
    vector = b"\x00\x00\x80?" * 3
    chunks, outputs = [], []
    for _ in range(10):  # bounded: 3 steps are needed
        step = scheduler.schedule()
        if not step.num_scheduled_tokens:
            break
        chunks.append(step.num_scheduled_tokens["p"])
        done = sum(chunks) == 20
        result = scheduler.update_from_output(
            step, _runner_output(step, {"p": vector} if done else {})
        )
        outputs.extend(result.outputs)
    assert chunks == [8, 8, 4]
    (output,) = outputs
    assert output.finish_reason == FinishReason.STOP and output.new_token_ids == []
    assert output.pooled == vector
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
