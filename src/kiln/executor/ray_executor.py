"""One Ray actor per rank, on a Ray cluster of one machine or many.

Contract:
- ``RayExecutor(config).initialize()`` connects to a cluster: ``parallel.ray_address``, else
  ``RAY_ADDRESS``, else a local cluster it starts (and stops at ``shutdown``); a connection this
  process already has is used as it is. It reserves a placement group of ``world_size`` bundles
  of one CPU each (PACK: ranks share a node while it has CPUs free and spread over nodes when it
  has not) and starts one actor (``RayWorker``) in each. With data parallelism each engine's
  ranks share one node (STRICT_PACK), engine ``i``'s the ``i``-th of the nodes (by node id) with
  a CPU per rank, wrapping around: each engine has its own node while there are as many.
  Rank 0's actor names the torch.distributed rendezvous every rank joins: with every rank on
  one node, a file store in a private directory there (and gloo on loopback); across nodes, its
  node's address and a free port there (never a wildcard bind); then each rank runs the
  platform's worker class (``start_worker``, as the multiprocess executor does) and loads its
  part of the model. All
  of it within ``START_TIMEOUT_S``; a rank that fails to start fails ``initialize`` with its
  traceback, and everything is released.
- Each call goes to every rank: its arguments are put in the object store once and the same
  object reaches every actor. ``execute_model`` returns the output rank's answer
  (``output_rank``); every rank answers the other calls. ``execute_model_async`` submits a batch
  and returns at once (an actor runs its calls in the order they were submitted).
- While it waits the executor watches every rank: an actor that dies fails the call within
  ``POLL_S`` of Ray reporting it with ``WorkerDiedError``, a rank that raises fails it with its
  traceback (the engine core then reports the error to every request in flight and exits).
  Between calls ``check_health()`` (which an idle engine core calls every second) collects the
  ranks' answers to the pings it sent the time before and pings again, never waiting: an actor
  that dies while the engine is idle raises ``WorkerDiedError`` within a call or two of Ray
  reporting it. Ray gives no file descriptor for an actor's exit, so ``sentinels()`` is empty.
- ``shutdown`` asks the ranks to stop, kills the actors, removes the placement group and
  disconnects: no actor outlives it. An engine core that dies takes its actors with it (Ray kills
  the actors of a driver that is gone).

``ray`` is an optional dependency (``pip install kiln[ray]``), imported only when this executor
starts. This module knows nothing about models or scheduling.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any

from kiln.config import KilnConfig
from kiln.distributed.parallel_state import output_rank, prepare_tensor_parallel_config
from kiln.executor import ModelOutputFuture, MultiRankExecutor
from kiln.executor.multiproc import (
    CALLS,
    SHUTDOWN_GRACE_S,
    WORKER_START_TIMEOUT_S,
    WorkerDiedError,
    loopback_gloo_env,
    start_worker,
)
from kiln.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id (a placement group's bundles may select on it)."""
START_TIMEOUT_S = WORKER_START_TIMEOUT_S
"""Longest the ranks may take to be placed, start and load, on a busy cluster."""
PLACEMENT_TIMEOUT_S = 120.0
"""Longest the cluster may take to find a CPU for every rank (a node may still be joining)."""
POLL_S = 0.1
"""How often a waiting executor checks its actors."""
LOCAL_OBJECT_STORE_BYTES = 100 * 1024 * 1024
"""Object store of a local cluster Kiln starts: only step messages cross it (Ray's minimum is
75 MiB; its default, 30 % of memory, is far more than this needs)."""


class RayWorker:
    """One rank inside a Ray actor: the platform's worker, once ``start`` has run."""

    def __init__(self, config: KilnConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.is_output_rank = rank == output_rank(config)
        self.worker: Any = None
        self.store_dir: str | None = None
        """Rank 0 on one node: the directory of the rendezvous file store."""
        logging.basicConfig(
            level=logging.INFO, format=f"%(levelname)s rank{rank} %(name)s: %(message)s"
        )

    def node(self) -> tuple[str, str]:
        """``(node id, node address)`` of the node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def rendezvous(self, is_one_node: bool) -> str:
        """The torch.distributed init method every rank joins (asked of rank 0's actor): on one
        node, a file store in a private directory of this node (torch's TCPStore would listen on
        every interface); across nodes, a TCP port free on this node's own address."""
        import ray

        if is_one_node:
            self.store_dir = tempfile.mkdtemp(prefix="kiln-ray-")
            return f"file://{self.store_dir}/store"
        address = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
            return f"tcp://{address}:{s.getsockname()[1]}"

    def ping(self) -> None:
        """Nothing: the answer (or Ray's ``RayActorError``) tells the executor the actor lives."""

    def start(self, local_rank: int, distributed_init_method: str, is_one_node: bool) -> None:
        if is_one_node:  # gloo's sockets on loopback: the ranks need no other interface
            os.environ.update(loopback_gloo_env())
        self.worker = start_worker(self.config, self.rank, local_rank, distributed_init_method)

    def call(self, method: str, args: tuple) -> Any:
        """``worker.method(*args)``; None for ``execute_model`` off the output rank."""
        if method not in CALLS:
            raise ValueError(f"call={method!r} is invalid; allowed: {list(CALLS)}")
        result = getattr(self.worker, method)(*args)
        if method == "shutdown" and self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        return None if method == "execute_model" and not self.is_output_rank else result


class RayExecutor(MultiRankExecutor):
    def __init__(self, config: KilnConfig) -> None:
        super().__init__(prepare_tensor_parallel_config(config))
        self.world_size = self.config.parallel.world_size
        self.output_rank = output_rank(self.config)
        self.actors: list[Any] = []
        self.node_ids: list[str] = []
        """Per rank, the Ray node its actor runs on (set by ``initialize``)."""
        self.placement_group: Any = None
        self.owns_connection = False
        self.is_shut_down = False
        self._pings: dict[int, Any] = {}
        """Per rank, the object ref of the ping ``check_health`` sent last and has no answer to."""

    def initialize(self) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ImportError(
                "parallel.distributed_executor_backend='ray' needs Ray: pip install 'kiln[ray]'"
            ) from exc
        atexit.register(self.shutdown)
        try:
            self._connect(ray)
            bundles = [{"CPU": 1.0}] * self.world_size
            placement = self._placement(ray)
            self.placement_group = placement_group(bundles, **placement)
            if not self.placement_group.wait(PLACEMENT_TIMEOUT_S):
                raise TimeoutError(
                    f"the Ray cluster found no CPU for each of {self.world_size} ranks within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s (it has {ray.cluster_resources().get('CPU', 0)} "
                    f"CPUs, {ray.available_resources().get('CPU', 0)} free; placement "
                    f"{placement})"
                )
            actor_cls = ray.remote(num_cpus=1)(RayWorker)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
                config = self.config.replace(parallel__rank=rank)
                self.actors.append(
                    actor_cls.options(scheduling_strategy=strategy).remote(config, rank)
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            nodes = self._get([actor.node.remote() for actor in self.actors], "start", deadline)
            self.node_ids = [node_id for node_id, _ in nodes]
            is_one_node = len(set(self.node_ids)) == 1
            rendezvous = self.actors[0].rendezvous.remote(is_one_node)
            init_method = self._get([rendezvous], "start", deadline)[0]
            local_ranks = [self.node_ids[:rank].count(n) for rank, n in enumerate(self.node_ids)]
            starts = [
                actor.start.remote(local_rank, init_method, is_one_node)
                for actor, local_rank in zip(self.actors, local_ranks, strict=True)
            ]
            self._get(starts, "start", deadline)
            logger.info(
                "%d ranks on %d Ray node(s), rendezvous %s",
                self.world_size,
                len(set(self.node_ids)),
                init_method,
            )
        except BaseException:
            self.shutdown()
            raise

    def _connect(self, ray: Any) -> None:
        """Join the configured cluster, or start a local one (``owns_connection``)."""
        if ray.is_initialized():
            return  # the caller's connection (a Ray job, a test): it stays theirs
        address = self.config.parallel.ray_address or os.environ.get("RAY_ADDRESS")
        is_main = threading.current_thread() is threading.main_thread()
        # NOTE: ray.init installs its own SIGTERM handler; the engine core keeps its own.
        sigterm = signal.getsignal(signal.SIGTERM) if is_main else None
        if address:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
        else:
            ray.init(
                address="local",
                num_cpus=self.world_size,
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                configure_logging=False,
            )
        if is_main:
            signal.signal(signal.SIGTERM, sigterm)
        self.owns_connection = True

    def _placement(self, ray: Any) -> dict[str, Any]:
        """The placement group's strategy (see the module docstring): PACK, or with data
        parallelism STRICT_PACK on this engine's node."""
        parallel = self.config.parallel
        if parallel.data_parallel_size == 1:
            return {"strategy": "PACK"}
        nodes = sorted(
            node["NodeID"]
            for node in ray.nodes()
            if node["Alive"] and node["Resources"].get("CPU", 0) >= self.world_size
        )
        if not nodes:
            return {"strategy": "STRICT_PACK"}  # none is big enough yet: wait for one to join
        node_id = nodes[parallel.data_parallel_rank % len(nodes)]
        return {
            "strategy": "STRICT_PACK",
            "bundle_label_selector": [{NODE_ID_LABEL: node_id}] * self.world_size,
        }

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelOutputFuture:
        return _RayBatchOutput(self, self._submit("execute_model", scheduler_output))

    def has_batch_output(self, refs: list[Any]) -> bool:
        """Whether the output rank has answered the batch of ``refs`` (never waits)."""
        import ray

        ready, _ = ray.wait([refs[self.output_rank]], timeout=0)
        return bool(ready)

    def take_batch_output(self, refs: list[Any]) -> ModelRunnerOutput:
        """The output rank's answer to the batch of ``refs``, watching every rank meanwhile."""
        return self._get(refs, "execute_model")[self.output_rank]

    def check_health(self) -> None:
        """Raises ``WorkerDiedError`` when a rank's actor has died (Ray reports it to the pings
        sent by the previous call); never waits."""
        import ray

        if self.is_shut_down:
            raise WorkerDiedError("the workers are shut down")
        pings = self._pings
        if pings:
            ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
            for rank in [rank for rank, ref in pings.items() if ref in ready]:
                self._result(pings.pop(rank), rank, "idle")
        for rank, actor in enumerate(self.actors):
            if rank not in pings:  # answered (or never pinged): ask again
                pings[rank] = actor.ping.remote()

    def shutdown(self) -> None:
        """Stop every rank (asked, then killed), free the placement group, disconnect (stopping
        a local cluster this executor started); idempotent."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        atexit.unregister(self.shutdown)
        import ray

        if not ray.is_initialized():
            return  # disconnected already (at exit): Ray took the actors with the driver
        if self.actors:
            stops = [actor.call.remote("shutdown", ()) for actor in self.actors]
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=SHUTDOWN_GRACE_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
        if self.owns_connection:
            ray.shutdown()

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method(*args)`` on every rank; their answers in rank order.

        Raises:
            WorkerDiedError: an actor died.
            RuntimeError: a rank raised (its traceback in the message).
        """
        return self._get(self._submit(method, *args), method)

    def _submit(self, method: str, *args: Any) -> list[Any]:
        """Start ``method(*args)`` on every rank; an object ref per rank, in rank order."""
        import ray

        if self.is_shut_down:
            raise WorkerDiedError("the workers are shut down")
        args_ref = ray.put(args)  # serialized once, fetched by every rank
        return [actor.call.remote(method, args_ref) for actor in self.actors]

    def _get(self, refs: list[Any], what: str, deadline: float | None = None) -> list[Any]:
        """The results of ``refs`` (one per rank, in rank order), failing as soon as any fails."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                results[rank] = self._result(ref, rank, what)
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(pending.values())
                raise TimeoutError(f"ranks {missing} did not {what} within {START_TIMEOUT_S:.0f} s")
        return results

    def _result(self, ref: Any, rank: int, what: str) -> Any:
        """The value of ``ref``, rank ``rank``'s answer (ready: this does not wait).

        Raises:
            WorkerDiedError: the rank's actor died.
            RuntimeError: the rank raised (its traceback in the message).
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayActorError as exc:
            raise WorkerDiedError(f"rank {rank}'s Ray actor died during {what}: {exc}") from None
        except RayTaskError as exc:
            raise RuntimeError(f"rank {rank} failed in {what}:\n{exc}") from None


class _RayBatchOutput(ModelOutputFuture):
    """A batch's output: the object refs of every rank's ``execute_model`` call."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor, self.refs = executor, refs

    def done(self) -> bool:
        return self.executor.has_batch_output(self.refs)

    def result(self) -> ModelRunnerOutput:
        return self.executor.take_batch_output(self.refs)


__all__ = ["RayExecutor", "RayWorker"]
