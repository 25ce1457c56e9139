"""Micro-benchmark: what tensor parallelism adds to one engine step, at TP=2 by default.

Two costs, each measured in fresh processes on this machine:

1. The step's collectives on the model's shapes (SmolLM2-135M by default: 30 layers, hidden 576,
   vocabulary 49,152): two all-reduces of ``[T, hidden]`` per layer (after attention and after
   the MLP), one for the embedding, and one all-gather of the logits ``[N, vocab / tp]``,
   through the cpu platform's communicator (``TorchDistCommunicator``, gloo). Printed per call
   and per step, for a decode step of 1 and 16 requests and a 256-token prefill.
2. The broadcast of a step's call (a pickled ``SchedulerOutput`` of a 16-request decode step) to
   every rank and rank 0's answer, round trip, over the transport ``MultiprocExecutor`` uses (ZMQ
   PUSH/PULL over ipc) and over ``multiprocessing`` pipes for comparison.

Best of ``--repeats`` medians; the figures depend on the load (print ``uptime`` beside them).
Run: ``PYTHONPATH=src python benchmarks/tp_comm.py [--tp 2] [--iters 200] [--layers 30]
[--hidden 576] [--vocab 49152]``; on a bigger machine pass the model's shapes and ``--tp``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import tempfile
import time

import torch


def _collectives(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:
    import torch.distributed as dist

    from kiln.distributed.communicator import TorchDistCommunicator

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp
    )
    comm = TorchDistCommunicator(rank, args.tp, torch.device("cpu"))
    results = {}
    for name, num_tokens, num_rows in (
        ("decode 1", 1, 1),
        ("decode 16", 16, 16),
        ("prefill 256", 256, 1),
    ):
        hidden = torch.randn(num_tokens, args.hidden)
        logits = torch.randn(num_rows, -(-args.vocab // args.tp))
        reduce_ms, gather_ms = [], []
        for _ in range(args.repeats):
            comm.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                comm.all_reduce(hidden)
            reduce_ms.append((time.perf_counter() - start) * 1e3 / args.iters)
            comm.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                comm.all_gather(logits)
            gather_ms.append((time.perf_counter() - start) * 1e3 / args.iters)
        results[name] = (min(reduce_ms), min(gather_ms))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _zmq_worker(addr_in: str, addr_out: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    while True:
        message = pull.recv()
        if message == b"stop":
            break
        pickle.loads(message)
        push.send(b"ok")
    ctx.destroy(linger=0)


def _pipe_worker(conn) -> None:
    while True:
        message = conn.recv_bytes()
        if message == b"stop":
            break
        pickle.loads(message)
        conn.send_bytes(b"ok")


def _scheduler_output(num_reqs: int) -> object:
    """A decode step of ``num_reqs`` running requests (one token each, no new blocks)."""
    from kiln.messages import CachedRequestData, SchedulerOutput

    req_ids = [f"cmpl-{i:032x}-0" for i in range(num_reqs)]
    cached = CachedRequestData(
        req_ids=req_ids,
        new_block_ids=[[] for _ in req_ids],
        num_computed_tokens=[300 + i for i in range(num_reqs)],
    )
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        total_num_scheduled_tokens=num_reqs,
        finished_req_ids=set(),
    )


def _best_us(step, args: argparse.Namespace) -> float:
    """Best over ``args.repeats`` of the mean microseconds of ``args.iters`` calls of ``step``."""
    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.iters):
            step()
        samples.append((time.perf_counter() - start) * 1e6 / args.iters)
    return min(samples)


def _broadcast(args: argparse.Namespace) -> dict[str, float]:
    import zmq

    payload = _scheduler_output(16)
    times: dict[str, float] = {}
    ctx = mp.get_context("spawn")
    # ZMQ: one PUSH socket per rank, one PULL for the answers (as MultiprocExecutor).
    folder = tempfile.mkdtemp(prefix="kiln-tpbench-")
    zctx = zmq.Context()
    out = zctx.socket(zmq.PULL)
    out.bind(f"ipc://{folder}/out")
    pushes, procs = [], []
    for rank in range(args.tp):
        push = zctx.socket(zmq.PUSH)
        push.bind(f"ipc://{folder}/in-{rank}")
        pushes.append(push)
        proc = ctx.Process(
            target=_zmq_worker, args=(f"ipc://{folder}/in-{rank}", f"ipc://{folder}/out")
        )
        proc.start()
        procs.append(proc)

    def zmq_step() -> None:
        message = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)  # once per step
        for push in pushes:
            push.send(message, copy=False)
        for _ in range(args.tp):  # every rank answers here: the slowest decides
            out.recv()

    times["zmq"] = _best_us(zmq_step, args)
    for push in pushes:
        push.send(b"stop")
    for proc in procs:
        proc.join()
    zctx.destroy(linger=0)
    # Pipes: one duplex pipe per rank.
    conns, procs = [], []
    for _ in range(args.tp):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_pipe_worker, args=(theirs,))
        proc.start()
        conns.append(mine)
        procs.append(proc)

    def pipe_step() -> None:
        message = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in conns:
            conn.send_bytes(message)
        for conn in conns:
            conn.recv_bytes()

    times["pipe"] = _best_us(pipe_step, args)
    for conn in conns:
        conn.send_bytes(b"stop")
    for proc in procs:
        proc.join()
    times["payload_bytes"] = len(pickle.dumps(payload))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collectives, args=(r, args, port, queue)) for r in range(args.tp)]
    for proc in procs:
        proc.start()
    results = queue.get()
    for proc in procs:
        proc.join()
    print(f"load: {os.getloadavg()[0]:.2f} (1 min), cores: {os.cpu_count()}, tp: {args.tp}")
    reduces_per_step = 2 * args.layers + 1
    print(
        f"collectives per step: {reduces_per_step} all-reduces of [T, {args.hidden}], 1 all-gather"
    )
    for name, (reduce_ms, gather_ms) in results.items():
        step = reduces_per_step * reduce_ms + gather_ms
        print(
            f"  {name:12s} all-reduce {reduce_ms * 1e3:7.1f} us, "
            f"all-gather {gather_ms * 1e3:7.1f} us, per step {step:6.2f} ms"
        )
    bcast = _broadcast(args)
    print(
        f"step call broadcast + answer ({bcast['payload_bytes']:.0f} B pickled): "
        f"zmq {bcast['zmq']:.0f} us, pipe {bcast['pipe']:.0f} us (best of {args.repeats})"
    )


if __name__ == "__main__":
    main()
