"""The P2P connector: disaggregated prefill, KV blocks pulled from one ``kiln serve`` by another.

A prefill instance (``kv_role`` "kv_producer") runs a request that carries
``kv_transfer_params`` ``{"do_remote_decode": true}`` (``max_tokens=1``, from ``kiln proxy``);
when it finishes, ``request_finished`` keeps its blocks held and returns where they wait
(``remote_host``/``remote_port``: this instance's block server; ``remote_request_id``,
``remote_block_ids``, ``remote_num_tokens`` and ``remote_prompt_hash``). The worker offers the
blocks to its ``BlockServer`` (``kiln.kv_transfer.p2p_wire``), which sends them to one pull and
reports the request in ``finished_sending``, so its blocks are freed; an offer nobody pulls
within ``kv_send_timeout`` seconds is dropped the same way, so a consumer that never comes
leaks nothing.

A decode instance (``kv_role`` "kv_consumer") gets those params with ``"do_remote_prefill":
true``. If its prompt starts with the producer's tokens (the hash), it answers the scheduler
that the whole blocks past its local prefix hit, up to but not including its last token, load
asynchronously: the request waits in ``WAITING_FOR_REMOTE_KVS`` holding its blocks while others
run. The worker pulls them in a background thread (every socket operation bounded by
``kv_load_timeout``), copies them into the paged cache in the step thread, before a forward,
and reports the request in ``finished_recving``; a pull that fails (producer gone, cut short,
corrupt: checksummed) reports its blocks as load errors, which ``kv_load_failure_policy``
turns into a recompute or a failed request. A request that finishes while it loads (aborted)
cancels its pull: the pulled bytes are dropped, never written into blocks freed meanwhile.

``kv_both`` does both. Options (``kv_connector_extra_config``): ``kv_host`` (default
"127.0.0.1": the address the block server binds and advertises), ``kv_port`` (default 14579),
``kv_send_timeout`` (60 s), ``kv_load_timeout`` (10 s), ``secret_file`` (none: a file whose
bytes, the same on every instance, are the shared secret that signs each pull and its answer,
``kiln.kv_transfer.p2p_wire``; without it anyone who can reach the block server and knows a
request id can read that request's KV). Single-rank engines only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kiln.kv_transfer.base import KVConnectorBase, KVConnectorRole
from kiln.kv_transfer.p2p_wire import BlockServer, TransferError, fetch_blocks
from kiln.kv_transfer.params import prompt_hash
from kiln.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from kiln.config import KilnConfig
    from kiln.messages import SchedulerOutput

logger = logging.getLogger(__name__)

_DEFAULTS = {
    "kv_host": "127.0.0.1",
    "kv_port": 14579,
    "kv_send_timeout": 60.0,
    "kv_load_timeout": 10.0,
    "secret_file": None,
}
IDLE_WAIT_S = 0.005
"""How long a step without a forward waits for a transfer to finish (so an engine that only
waits for transfers does not spin)."""


@dataclass
class P2pLoad:
    """One pull: the producer's blocks ``remote_block_ids`` into this engine's ``block_ids``."""

    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    block_ids: list[int]


@dataclass
class P2pMetadata:
    """One step's work for the worker."""

    idle: bool = False
    """The step has no forward: the worker may wait a little for a transfer."""
    offers: dict[str, list[int]] = field(default_factory=dict)
    """Producer: finished requests whose blocks to serve, by request id."""
    loads: dict[str, P2pLoad] = field(default_factory=dict)
    """Consumer: pulls to start, by request id."""
    cancels: list[str] = field(default_factory=list)
    """Consumer: requests whose pull to drop (they finished)."""


def _options(config: KilnConfig) -> dict[str, Any]:
    """The connector's options, checked.

    Raises:
        ValueError: an option of the wrong type or range, or a multi-rank engine.
    """
    extra = {**_DEFAULTS, **config.kv_transfer.kv_connector_extra_config}
    if config.parallel.world_size != 1:
        raise ValueError(
            f"kv_transfer.kv_connector='P2pConnector' with {config.parallel.world_size} ranks is "
            "invalid; allowed: a single-rank engine (tensor and pipeline parallel size 1)"
        )
    port = extra["kv_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(
            f"kv_transfer.kv_connector_extra_config.kv_port={port!r} is invalid; allowed: a "
            "TCP port, 1 to 65535"
        )
    if not isinstance(extra["kv_host"], str) or not extra["kv_host"]:
        raise ValueError(
            f"kv_transfer.kv_connector_extra_config.kv_host={extra['kv_host']!r} is invalid; "
            "allowed: a host name or address"
        )
    for name in ("kv_send_timeout", "kv_load_timeout"):
        value = extra[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"kv_transfer.kv_connector_extra_config.{name}={value!r} is invalid; allowed: "
                "seconds above 0"
            )
    extra["secret"] = _read_secret(extra["secret_file"])
    return extra


def _read_secret(path: Any) -> bytes | None:
    """The shared secret in the file ``path`` (None for no file).

    Raises:
        ValueError: not a path, unreadable, or empty.
    """
    if path is None:
        return None
    name = "kv_transfer.kv_connector_extra_config.secret_file"
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name}={path!r} is invalid; allowed: the path of a non-empty file")
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as exc:
        raise ValueError(f"{name}={path!r} cannot be read ({exc.strerror})") from None
    if not secret:
        raise ValueError(f"{name}={path!r} is empty; allowed: a file holding the secret")
    return secret


class P2pConnector(KVConnectorBase):
    """KV blocks between two engines over TCP (see the module docstring).

    Raises:
        ValueError: an invalid option (names it), or a multi-rank engine.
        OSError: (worker side, producer) the block server's port cannot be bound.
    """

    def __init__(self, config: KilnConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        options = _options(config)
        kv_role = config.kv_transfer.kv_role
        self.saves = kv_role != "kv_consumer"
        self.loads = kv_role != "kv_producer"
        self.host: str = options["kv_host"]
        self.port: int = options["kv_port"]
        self.send_timeout = float(options["kv_send_timeout"])
        self.load_timeout = float(options["kv_load_timeout"])
        self.secret: bytes | None = options["secret"]
        self.block_size = config.cache.block_size
        # Scheduler side.
        self._step = P2pMetadata()
        self._asked: set[str] = set()
        """Requests whose pull was started: never asked for again (a preempted one finds the
        loaded blocks in its local prefix cache, or recomputes)."""
        # Worker side.
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._layout: dict[str, Any] = {}
        self._server: BlockServer | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pulls: dict[str, tuple[P2pLoad, concurrent.futures.Future[bytearray]]] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stats: dict[str, float] = {}

    # -- scheduler side ------------------------------------------------------------------------

    def _remote_blocks(self, request: Request) -> int:
        """Leading blocks of ``request`` whose KV its ``kv_transfer_params`` offer: whole
        blocks of the producer's tokens, never its last token; 0 for none or for a producer
        whose tokens are not the start of this prompt."""
        params = request.kv_transfer_params
        if not self.loads or not params or params.get("do_remote_prefill") is not True:
            return 0
        if request.request_id in self._asked:
            return 0
        block_ids = params.get("remote_block_ids")
        num_tokens = params.get("remote_num_tokens")
        if not isinstance(block_ids, list) or not isinstance(num_tokens, int):
            return 0
        if params.get("remote_prompt_hash") != prompt_hash(request.prompt_token_ids[:num_tokens]):
            logger.warning(
                "request %s: kv_transfer_params are of another prompt; it is computed here",
                request.request_id,
            )
            return 0
        return min(len(block_ids), min(num_tokens, request.num_tokens - 1) // self.block_size)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        num_blocks = self._remote_blocks(request) - num_computed_tokens // self.block_size
        return max(num_blocks, 0) * self.block_size, num_blocks > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        assert params is not None
        num_blocks = num_external_tokens // self.block_size
        start = len(block_ids) - num_blocks
        self._asked.add(request.request_id)
        self._step.loads[request.request_id] = P2pLoad(
            host=params["remote_host"],
            port=params["remote_port"],
            remote_request_id=params["remote_request_id"],
            remote_block_ids=params["remote_block_ids"][start : start + num_blocks],
            block_ids=block_ids[start:],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pMetadata | None:
        step, self._step = self._step, P2pMetadata()
        step.idle = scheduler_output.total_num_scheduled_tokens == 0
        return step if step.idle or step.offers or step.loads or step.cancels else None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._asked:
            self._asked.discard(request_id)
            self._step.loads.pop(request_id, None)
            self._step.cancels.append(request_id)
        params = request.kv_transfer_params
        if not self.saves or not params or params.get("do_remote_decode") is not True:
            return False, None
        finished_well = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if request.status not in finished_well or not num_tokens or not block_ids:
            return False, None
        block_ids = block_ids[: -(-num_tokens // self.block_size)]
        self._step.offers[request_id] = block_ids
        return True, {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request_id,
            "remote_block_ids": block_ids,
            "remote_num_tokens": num_tokens,
            "remote_prompt_hash": prompt_hash(request.prompt_token_ids[:num_tokens]),
        }

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_dim: int) -> None:
        self._caches = list(kv_caches.values())
        self._block_dim = block_dim
        self._layout = {
            "layer_block_bytes": [
                c.element_size() * c.numel() // c.shape[block_dim] for c in self._caches
            ],
            "dtypes": [str(c.dtype) for c in self._caches],
        }
        if self.saves:
            try:
                self._server = BlockServer(self.host, self.port, self._read_blocks, self.secret)
            except OSError as exc:
                raise OSError(
                    f"kv_transfer.kv_connector_extra_config kv_host={self.host!r} kv_port="
                    f"{self.port}: the P2P connector's block server cannot listen there ({exc})"
                ) from exc
        if self.loads:
            self._pool = concurrent.futures.ThreadPoolExecutor(4, "kiln-kv-pull")

    def _read_blocks(self, block_ids: list[int]) -> tuple[dict[str, Any], bytes]:
        """The KV of ``block_ids``, layer after layer (a serving thread's read)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._caches[0].device)
        parts = [c.index_select(self._block_dim, index).cpu() for c in self._caches]
        payload = b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts)
        return {**self._layout, "num_blocks": len(block_ids)}, payload

    def start_load_kv(self) -> None:
        metadata: P2pMetadata | None = self._metadata
        if metadata is None:
            return
        for request_id, block_ids in metadata.offers.items():
            assert self._server is not None
            self._server.offer(request_id, block_ids, self.send_timeout)
        for request_id in metadata.cancels:
            self._pulls.pop(request_id, None)
        for request_id, load in metadata.loads.items():
            assert self._pool is not None
            future = self._pool.submit(
                fetch_blocks,
                load.host,
                load.port,
                load.remote_request_id,
                load.remote_block_ids,
                self._layout,
                self.load_timeout,
                self.secret,
            )
            self._pulls[request_id] = (load, future)
        if metadata.idle and self._pulls:
            futures = [future for _, future in self._pulls.values()]
            concurrent.futures.wait(futures, IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
        self._finish_pulls()

    def _finish_pulls(self) -> None:
        """Copy the pulls that arrived into their blocks; a failed one's blocks are load
        errors. Either way the request is reported in ``finished_recving``."""
        for request_id, (load, future) in list(self._pulls.items()):
            if not future.done():
                continue
            del self._pulls[request_id]
            self._recving.add(request_id)
            try:
                payload = future.result()
            except TransferError as exc:
                logger.warning("request %s: its KV did not load: %s", request_id, exc)
                self._load_errors.update(load.block_ids)
                continue
            start = time.perf_counter()
            self._write_blocks(load.block_ids, payload)
            stats = self._stats
            stats["loaded_blocks"] = stats.get("loaded_blocks", 0) + len(load.block_ids)
            stats["loaded_bytes"] = stats.get("loaded_bytes", 0) + len(payload)
            stats["load_seconds"] = stats.get("load_seconds", 0) + time.perf_counter() - start

    def _write_blocks(self, block_ids: list[int], payload: bytearray) -> None:
        """``payload`` (``_read_blocks``' layout, checked) into ``block_ids`` of every layer."""
        dim = self._block_dim
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._caches[0].device)
        offset = 0
        for cache, size in zip(self._caches, self._layout["layer_block_bytes"], strict=True):
            count = size * len(block_ids)
            part = torch.frombuffer(payload, dtype=torch.uint8, count=count, offset=offset)
            offset += count
            shape = list(cache.shape)
            shape[dim] = len(block_ids)
            cache.index_copy_(dim, index, part.view(cache.dtype).reshape(shape).to(cache.device))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        if self._server is not None:
            idle = self._metadata is not None and self._metadata.idle
            sending = self._server.take_done(IDLE_WAIT_S if idle else 0.0)
        recving, self._recving = self._recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        if self._server is not None:
            for name, value in self._server.take_stats().items():
                stats[name] = stats.get(name, 0) + value
        return stats


__all__ = ["P2pConnector", "P2pLoad", "P2pMetadata"]
