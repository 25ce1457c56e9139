"""Nothing of ``kiln serve`` listens beyond loopback unless ``--host`` asks (issue 26 item 4):
the sockets of the server's whole process tree (API server, engine core, tensor-parallel ranks)
at TP=1 and at TP=2 with the multiprocess executor, after a request has run through every rank.
A wildcard bind (``0.0.0.0``, ``::``) or an address off loopback (the machine's own address, as
gloo takes by default) fails the test."""

from __future__ import annotations

import ipaddress

import httpx
import psutil
import pytest

from kiln.testing.server import BASE_ARGS, KilnServer

pytestmark = pytest.mark.slow


def listeners(pid: int) -> list[tuple[int, str, str, int]]:
    """``(pid, name, address, port)`` of each TCP socket listening, and each UDP socket bound, in
    the process tree of ``pid``."""
    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            is_udp_bound = conn.type == 2 and conn.laddr and not conn.raddr  # SOCK_DGRAM
            if conn.status == psutil.CONN_LISTEN or is_udp_bound:
                found.append((proc.pid, name, conn.laddr.ip, conn.laddr.port))
    return found


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-mp"])
def test_every_listener_is_on_loopback(gguf_path: str, tp: int) -> None:
    server = KilnServer(
        [*BASE_ARGS, "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"],
        start_timeout=600,
    )
    try:
        body = {"prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
        found = listeners(server.proc.pid)
        print("\n".join(f"pid {p} {n}: {a}:{port}" for p, n, a, port in found))
        assert (server.proc.pid, "127.0.0.1", server.port) in [(p, a, q) for p, _, a, q in found]
        off_loopback = [entry for entry in found if not ipaddress.ip_address(entry[2]).is_loopback]
        assert not off_loopback, f"listening beyond loopback: {off_loopback}"
    finally:
        server.stop()
