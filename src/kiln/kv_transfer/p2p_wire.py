"""The P2P connector's wire: KV blocks from a prefill instance to a decode instance over TCP.

One connection per pull. The consumer sends ``MAGIC``, then one JSON line ``{"request_id",
"block_ids"}``. The producer answers a 4-byte big-endian length, a JSON header (``ok``, or
``error``; ``layer_block_bytes``, ``dtypes``, ``num_blocks``, ``payload_bytes``, ``crc32``)
and the payload: for each layer in order, the requested blocks' bytes as
``cache.index_select(block_dim, ids)`` lays them out. The consumer checks the layout against its
own, reads exactly ``payload_bytes`` and checks the CRC-32: a short, foreign or corrupt answer is
a ``TransferError``, never KV.

With a shared secret (both sides the same bytes) each pull carries ``auth``, an HMAC-SHA256 of
its request id and block ids: a producer with a secret refuses a pull without the right one
(and keeps the offer for the real consumer), so knowing a request id no longer suffices to read
its KV. Its answer's header carries ``auth`` too, an HMAC of the request id and the payload's
CRC-32, which a consumer with a secret checks: KV comes only from a producer that knows the
secret. The bytes themselves travel in the clear (no encryption).

``BlockServer`` (producer) serves the blocks it is offered, each pull in a thread of its own,
and reports a request done once its blocks are sent, or once its offer expires unpulled.
``fetch_blocks`` (consumer) is one bounded pull: every socket operation has a timeout.

This module knows sockets and bytes; which blocks and when is the connector's
(``kiln.kv_transfer.p2p``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import socketserver
import struct
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"KILNKV1\n"
MAX_REQUEST_LINE = 1 << 21
"""The most bytes a pull's JSON line may take (the server drops a longer one)."""
OFFER_WAIT_S = 5.0
"""How long a pull waits for its request's offer (the HTTP answer may overtake the engine's
next step, which makes the offer)."""

ReadBlocks = Callable[[list[int]], tuple[dict[str, Any], bytes]]
"""The producer's reader: block ids -> (layout header fields, payload)."""


class TransferError(Exception):
    """A pull that gave no usable KV (refused, cut short, foreign or corrupt)."""


def sign(secret: bytes, *parts: Any) -> str:
    """HMAC-SHA256 of ``parts`` (as one JSON array) under ``secret``, in hex."""
    return hmac.new(secret, json.dumps(parts).encode(), hashlib.sha256).hexdigest()


class BlockServer:
    """Serves offered blocks to pulls on ``(host, port)``, in daemon threads.

    Args:
        read_blocks: reads the offered blocks' KV (called in a serving thread: the blocks are
            held for the offer, so nothing writes them meanwhile).
        secret: the shared secret every pull must sign with (None: any pull is served).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(
        self, host: str, port: int, read_blocks: ReadBlocks, secret: bytes | None = None
    ) -> None:
        self.read_blocks = read_blocks
        self.secret = secret
        self._cond = threading.Condition()
        self._offers: dict[str, tuple[list[int], float]] = {}
        """Request id -> (its block ids, when the offer expires on the monotonic clock)."""
        self._done: set[str] = set()
        self._stats = {"saved_blocks": 0.0, "saved_bytes": 0.0, "save_seconds": 0.0}
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                server._serve(self.connection, self.rfile)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._tcp = socketserver.ThreadingTCPServer((host, port), Handler)
        self._tcp.daemon_threads = True
        threading.Thread(target=self._tcp.serve_forever, name="kiln-kv-p2p", daemon=True).start()

    def offer(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        """Serve ``block_ids`` to one pull of ``request_id`` within ``timeout_s``."""
        with self._cond:
            self._offers[request_id] = (block_ids, time.monotonic() + timeout_s)
            self._cond.notify_all()

    def take_done(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose blocks were sent or whose offer expired since the last call (waiting
        up to ``wait_s`` for one while offers are open)."""
        with self._cond:
            if not self._done and self._offers and wait_s > 0:
                self._cond.wait(wait_s)
            now = time.monotonic()
            for request_id, (_, deadline) in list(self._offers.items()):
                if deadline < now:
                    del self._offers[request_id]
                    self._done.add(request_id)
            done, self._done = self._done, set()
            return done

    def take_stats(self) -> dict[str, float]:
        with self._cond:
            stats = {k: v for k, v in self._stats.items() if v}
            self._stats = dict.fromkeys(self._stats, 0.0)
        return stats

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()

    def _take_offer(self, request_id: str) -> list[int] | None:
        """The offer of ``request_id`` (waiting for it up to ``OFFER_WAIT_S``), now taken."""
        deadline = time.monotonic() + OFFER_WAIT_S
        with self._cond:
            while request_id not in self._offers and request_id not in self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            offer = self._offers.pop(request_id, None)
            return None if offer is None else offer[0]

    def _serve(self, sock: socket.socket, rfile: Any) -> None:
        """One pull: check it, send the blocks (or an error); the request is done either way."""
        sock.settimeout(OFFER_WAIT_S * 2)
        try:
            if rfile.read(len(MAGIC)) != MAGIC:
                return
            line = rfile.readline(MAX_REQUEST_LINE)
            ask = json.loads(line)
            request_id, block_ids = str(ask["request_id"]), list(ask["block_ids"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if self.secret is not None and not hmac.compare_digest(
            str(ask.get("auth", "")), sign(self.secret, request_id, block_ids)
        ):
            logger.warning("refused a pull of %r without the shared secret", request_id)
            _send_header(sock, {"ok": False, "error": "the pull is not signed with the secret"})
            return  # the offer stays for the consumer that has the secret
        offered = self._take_offer(request_id)
        if offered is None or not set(block_ids) <= set(offered):
            _send_header(sock, {"ok": False, "error": f"no blocks offered for {request_id!r}"})
            return
        start = time.perf_counter()
        payload = b""
        try:
            header, payload = self.read_blocks(block_ids)
            crc = zlib.crc32(payload)
            header = {**header, "ok": True, "payload_bytes": len(payload), "crc32": crc}
            if self.secret is not None:
                header["auth"] = sign(self.secret, request_id, crc)
            _send_header(sock, header)
            sock.sendall(payload)
            sent = True
        except Exception:  # the consumer went away, or the read failed: it recomputes or fails
            logger.warning("sending the KV of %s failed", request_id, exc_info=True)
            sent = False
        with self._cond:
            self._done.add(request_id)
            if sent:
                self._stats["saved_blocks"] += len(block_ids)
                self._stats["saved_bytes"] += len(payload)
                self._stats["save_seconds"] += time.perf_counter() - start
            self._cond.notify_all()


def _send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    received = 0
    while received < num_bytes:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise TransferError(f"connection closed after {received} of {num_bytes} bytes")
        received += n
    return buffer


def fetch_blocks(
    host: str,
    port: int,
    request_id: str,
    block_ids: list[int],
    layout: dict[str, Any],
    timeout_s: float,
    secret: bytes | None = None,
) -> bytearray:
    """Pull ``block_ids`` of ``request_id`` from the producer at ``host:port``.

    Args:
        layout: this side's ``layer_block_bytes`` and ``dtypes``, which the answer must match.
        timeout_s: the bound on connecting and on each read.
        secret: the shared secret to sign the pull with and to check the answer's ``auth``
            against (None: neither).

    Returns:
        The payload (see the module docstring), checked.

    Raises:
        TransferError: refused, unreachable, timed out, cut short, foreign or corrupt.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            ask: dict[str, Any] = {"request_id": request_id, "block_ids": block_ids}
            if secret is not None:
                ask["auth"] = sign(secret, request_id, block_ids)
            sock.sendall(MAGIC + json.dumps(ask).encode() + b"\n")
            (size,) = struct.unpack(">I", _recv_exactly(sock, 4))
            if size > MAX_REQUEST_LINE:
                raise TransferError(f"a header of {size} bytes")
            header = json.loads(_recv_exactly(sock, size))
            _check_header(header, layout, len(block_ids))
            payload = _recv_exactly(sock, header["payload_bytes"])
    except (OSError, ValueError) as exc:
        raise TransferError(f"pull from {host}:{port} failed: {exc}") from exc
    if zlib.crc32(payload) != header["crc32"]:
        raise TransferError(f"pull from {host}:{port}: the payload's CRC-32 does not match")
    if secret is not None and not hmac.compare_digest(
        str(header.get("auth", "")), sign(secret, request_id, header["crc32"])
    ):
        raise TransferError(f"pull from {host}:{port}: the answer is not signed with the secret")
    return payload


def _check_header(header: Any, layout: dict[str, Any], num_blocks: int) -> None:
    """Raises ``TransferError`` unless ``header`` announces ``num_blocks`` blocks of
    ``layout``."""
    if not isinstance(header, dict) or header.get("ok") is not True:
        error = header.get("error") if isinstance(header, dict) else header
        raise TransferError(f"the producer refused: {error}")
    for key in ("layer_block_bytes", "dtypes"):
        if header.get(key) != layout[key]:
            raise TransferError(f"{key} {header.get(key)} differs from ours {layout[key]}")
    expected = num_blocks * sum(layout["layer_block_bytes"])
    if header.get("num_blocks") != num_blocks or header.get("payload_bytes") != expected:
        raise TransferError(f"announced {header.get('payload_bytes')} bytes, not {expected}")
    if not isinstance(header.get("crc32"), int):
        raise TransferError("no CRC-32")


__all__ = ["BlockServer", "TransferError", "fetch_blocks", "sign"]
