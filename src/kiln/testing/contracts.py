"""The kit's checks of the scheduler and communicator contracts, without a model (run in a fresh
process by ``kiln.testing.checks``).

- ``scheduler``: the platform's ``scheduler_cls``, built from the platform-configured config with
  a small token budget, against a fake model runner that samples a token for every request whose
  prompt is computed. Every step must keep to ``scheduler.max_num_batched_tokens`` and
  ``scheduler.max_num_seqs`` of the config (a scheduler may schedule less, never more), schedule
  each request contiguously (what it hands out continues from the request's computed tokens), and
  every request must end with ``max_tokens`` tokens, the ones the runner sampled.
- ``communicator``: the platform's ``communicator_cls`` in three processes joined with its
  ``dist_backend``: ``all_reduce`` returns the sum (callers use what it returns; it may reduce
  in place), ``all_gather`` concatenates in rank order, ``broadcast``, ``send``/``recv``, and,
  for a class that takes ``ranks=``, a sub-group of two of the three ranks, which the class
  creates itself, made by its members only.
"""

from __future__ import annotations

import inspect
import os
import socket
import traceback
from typing import Any

SCHEDULER_BUDGET = 16
SCHEDULER_MAX_SEQS = 4
SCHEDULER_MAX_TOKENS = 4
SCHEDULER_STEPS = 500
SHARED_PREFIX = list(range(1000, 1040))
SCHEDULER_PROMPTS = [
    list(range(100, 103)),
    SHARED_PREFIX + [7, 8],
    list(range(200, 237)),
    SHARED_PREFIX + [9],
    list(range(300, 305)),
    list(range(400, 420)),
]
"""Prompts shorter and longer than the budget (chunked prefill), two sharing a prefix."""


def check_scheduler(platform: str) -> dict[str, Any]:
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig, SchedulerConfig
    from kiln.messages import ModelRunnerOutput
    from kiln.plugins import init_process
    from kiln.plugins.interfaces import resolve_class
    from kiln.sampling_params import SamplingParams
    from kiln.scheduler.request import Request

    config = init_process(
        "worker",
        KilnConfig(
            model=ModelConfig(max_model_len=256),
            scheduler=SchedulerConfig(
                max_num_seqs=SCHEDULER_MAX_SEQS, max_num_batched_tokens=SCHEDULER_BUDGET
            ),
            device=DeviceConfig(platform=platform),
        ),
    )
    budget, max_seqs = config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
    scheduler = resolve_class("scheduler_cls", config.device.scheduler_cls)(config, 128)
    params = SamplingParams(temperature=0, max_tokens=SCHEDULER_MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(SCHEDULER_PROMPTS):
        scheduler.add_request(Request(f"r{index}", list(prompt), params, arrival_time=index))
    problems: list[str] = []
    tokens: dict[str, list[int]] = {}  # the runner's view: prompt, then sampled tokens
    computed: dict[str, int] = {}
    sampled: dict[str, list[int]] = {}
    emitted: dict[str, list[int]] = {}
    finished: set[str] = set()
    steps = 0
    while scheduler.has_unfinished_requests() and steps < SCHEDULER_STEPS and not problems:
        steps += 1
        out = scheduler.schedule()
        scheduled = out.num_scheduled_tokens
        if out.total_num_scheduled_tokens > budget or len(scheduled) > max_seqs:
            problems.append(
                f"step {steps} scheduled {out.total_num_scheduled_tokens} tokens of "
                f"{len(scheduled)} requests; the config allows {budget} tokens "
                f"(scheduler.max_num_batched_tokens) of {max_seqs} (scheduler.max_num_seqs)"
            )
        for req_id in out.finished_req_ids:
            tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, num in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if computed.get(req_id) != num:
                problems.append(
                    f"step {steps}: {req_id} continues at token {num}, not {computed.get(req_id)}"
                )
        req_ids = list(scheduled)
        rows: list[list[int]] = []
        for req_id in req_ids:
            num = scheduled[req_id]
            if num <= 0 or req_id not in tokens or computed[req_id] + num > len(tokens[req_id]):
                problems.append(f"step {steps}: {req_id} was given {num} tokens it does not have")
                rows.append([])
                continue
            computed[req_id] += num
            if computed[req_id] == len(tokens[req_id]):
                token = 500 + len(tokens[req_id]) % 50
                tokens[req_id].append(token)
                sampled.setdefault(req_id, []).append(token)
                rows.append([token])
            else:
                rows.append([])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=rows,
        )
        result = scheduler.update_from_output(out, runner_output)
        for output in getattr(result, "outputs", None) or []:
            emitted.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished.add(output.request_id)
    if not problems and scheduler.has_unfinished_requests():
        problems.append(f"requests still unfinished after {steps} steps")
    for index in range(len(SCHEDULER_PROMPTS)):
        req_id = f"r{index}"
        if problems:
            break
        if req_id not in finished or len(emitted.get(req_id, [])) != SCHEDULER_MAX_TOKENS:
            problems.append(
                f"{req_id} ended with {emitted.get(req_id, [])} (finished: {req_id in finished}); "
                f"want {SCHEDULER_MAX_TOKENS} tokens (max_tokens, ignore_eos)"
            )
        elif emitted[req_id] != sampled[req_id][-SCHEDULER_MAX_TOKENS:]:
            problems.append(
                f"{req_id} emitted {emitted[req_id]}, the runner sampled {sampled[req_id]}"
            )
    return {
        "scheduler_cls": config.device.scheduler_cls,
        "budget": budget,
        "max_num_seqs": max_seqs,
        "steps": steps,
        "problems": problems,
    }


COMMUNICATOR_WORLD = 3
SUB_GROUP = [1, 2]


def check_communicator(platform: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    processes = [
        mp.get_context("spawn").Process(
            target=_communicator_rank, args=(platform, rank, port, queue)
        )
        for rank in range(COMMUNICATOR_WORLD)
    ]
    for process in processes:
        process.start()
    results = [queue.get() for _ in processes]
    for process in processes:
        process.join(timeout=60)
    results.sort(key=lambda r: r["rank"])
    return {
        "communicator_cls": results[0].get("communicator_cls"),
        "sub_groups": results[0].get("sub_groups"),
        "problems": [p for r in results for p in r["problems"]],
    }


def _communicator_rank(platform: str, rank: int, port: int, queue: Any) -> None:
    problems: list[str] = []
    result: dict[str, Any] = {"rank": rank, "problems": problems}
    try:
        _run_communicator_rank(platform, rank, port, result)
    except Exception:
        problems.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    queue.put(result)


def _run_communicator_rank(platform: str, rank: int, port: int, result: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from kiln.config import DeviceConfig, KilnConfig
    from kiln.plugins import init_process
    from kiln.plugins.interfaces import resolve_class

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = init_process("worker", KilnConfig(device=DeviceConfig(platform=platform)))
    from kiln.platforms import current_platform

    problems = result["problems"]
    cls = resolve_class("communicator_cls", config.device.communicator_cls)
    result["communicator_cls"] = config.device.communicator_cls
    device = current_platform.get_device(rank % max(1, current_platform.device_count()))
    current_platform.set_device(device)
    dist.init_process_group(current_platform.dist_backend, rank=rank, world_size=3)
    try:
        comm = cls(rank, COMMUNICATOR_WORLD, device)
        x = torch.full((2, 3), float(rank + 1), device=device)
        summed = comm.all_reduce(x)
        if summed is None or not torch.equal(summed.cpu(), torch.full((2, 3), 6.0)):
            problems.append(
                f"rank {rank}: all_reduce returned {_listed(summed)}, not the sum over ranks (the "
                "caller uses what it returns; reducing in place is allowed)"
            )
        part = torch.full((1, 2), float(rank), device=device)
        gathered = comm.all_gather(part, dim=0).cpu()
        if not torch.equal(gathered, torch.arange(3.0)[:, None].expand(3, 2)):
            problems.append(f"rank {rank}: all_gather(dim=0) gave {gathered.tolist()}")
        value = torch.full((2,), float(rank + 10), device=device)
        got = comm.broadcast(value, src=1).cpu()
        if not torch.equal(got, torch.full((2,), 11.0)):
            problems.append(f"rank {rank}: broadcast(src=1) gave {got.tolist()}")
        if rank == 0:
            comm.send(torch.arange(4.0, device=device), 2)
        elif rank == 2:
            got = comm.recv(torch.empty(4, device=device), 0).cpu()
            if not torch.equal(got, torch.arange(4.0)):
                problems.append(f"rank 2: recv from rank 0 gave {got.tolist()}")
        takes_ranks = "ranks" in inspect.signature(cls).parameters
        result["sub_groups"] = takes_ranks
        if takes_ranks and rank in SUB_GROUP:
            # Made by the sub-group's members only: rank 0 makes no call for it.
            sub = cls(SUB_GROUP.index(rank), len(SUB_GROUP), device, ranks=SUB_GROUP)
            summed = sub.all_reduce(torch.full((2,), float(rank), device=device))
            if summed is None or not torch.equal(summed.cpu(), torch.full((2,), 3.0)):
                problems.append(
                    f"rank {rank}: all_reduce over the sub-group ranks={SUB_GROUP} returned "
                    f"{_listed(summed)}, not the sum over its members (3.0)"
                )
        comm.barrier()
    finally:
        dist.destroy_process_group()


def _listed(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value
