"""The P2P wire's shared secret (``kiln.kv_transfer.p2p_wire``): a producer with a secret serves
only pulls signed with it, and keeps the offer for the consumer that has it; a consumer with a
secret takes KV only from a producer that signs its answer. Real sockets on loopback, no model."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kiln.config import KilnConfig, KVTransferConfig
from kiln.kv_transfer.p2p import _options
from kiln.kv_transfer.p2p_wire import BlockServer, TransferError, fetch_blocks
from kiln.testing.server import free_port

LAYOUT = {"layer_block_bytes": [8], "dtypes": ["torch.bfloat16"]}
SECRET = b"a shared secret"


def read_blocks(block_ids: list[int]) -> tuple[dict, bytes]:
    return {**LAYOUT, "num_blocks": len(block_ids)}, b"".join(bytes([i]) * 8 for i in block_ids)


@pytest.fixture
def producer(request) -> Iterator[tuple[BlockServer, int]]:
    port = free_port()
    server = BlockServer("127.0.0.1", port, read_blocks, secret=request.param)
    try:
        yield server, port
    finally:
        server.close()


def pull(port: int, request_id: str, secret: bytes | None) -> bytearray:
    return fetch_blocks("127.0.0.1", port, request_id, [3, 5], LAYOUT, 5.0, secret)


@pytest.mark.parametrize("producer", [SECRET], indirect=True)
def test_an_unsigned_or_wrongly_signed_pull_is_refused_and_the_offer_kept(producer):
    server, port = producer
    server.offer("req-1", [3, 5], timeout_s=30)
    for secret in (None, b"another secret"):
        with pytest.raises(TransferError, match="not signed with the secret"):
            pull(port, "req-1", secret)
    assert server.take_done() == set()  # still offered
    assert bytes(pull(port, "req-1", SECRET)) == bytes([3]) * 8 + bytes([5]) * 8
    # The server marks it done after its last send, which the pull may see returned first.
    done: set[str] = set()
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = server.take_done()
        time.sleep(0.01)
    assert done == {"req-1"}


@pytest.mark.parametrize("producer", [None], indirect=True)
def test_a_consumer_with_a_secret_refuses_an_unsigned_answer(producer):
    server, port = producer
    server.offer("req-2", [3, 5], timeout_s=30)
    with pytest.raises(TransferError, match="answer is not signed"):
        pull(port, "req-2", SECRET)


@pytest.mark.parametrize("producer", [None], indirect=True)
def test_without_secrets_any_pull_is_served(producer):
    server, port = producer
    server.offer("req-3", [3, 5], timeout_s=30)
    assert len(pull(port, "req-3", None)) == 16


def _config(extra: dict) -> KilnConfig:
    return KilnConfig(
        kv_transfer=KVTransferConfig(
            kv_connector="P2pConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    )


def test_the_secret_is_read_from_its_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert _options(_config({"secret_file": str(path)}))["secret"] == SECRET
    assert _options(_config({}))["secret"] is None


@pytest.mark.parametrize("content", [None, b"", b" \n"])
def test_a_missing_or_empty_secret_file_is_a_value_error(tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="kv_connector_extra_config.secret_file"):
        _options(_config({"secret_file": str(path)}))
