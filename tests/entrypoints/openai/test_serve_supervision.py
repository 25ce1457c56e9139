"""The API server's output reader: frames on its socket that do not decode (a version skew, a
bug, a local process writing to it) are logged and dropped; the server goes on serving."""

from __future__ import annotations

import glob
import time

import httpx
import msgspec
import openai
import zmq

from kiln.messages import EngineCoreOutputs
from kiln.testing.server import KilnServer, ipc_dirs

MALFORMED = [
    [b"outputs", b"\xc1 not msgpack"],
    [b"outputs", msgspec.msgpack.encode({"outputs": "not a list"})],
    [b"outputs", msgspec.msgpack.encode(EngineCoreOutputs(engine_index=7))],  # no such engine
    [b"outputs"],
    [b"ready", b"", b""],
]


def _send_to_output_socket(server: KilnServer, frames: list[list[bytes]]) -> None:
    """Write ``frames`` to the socket the API server reads engine outputs from."""
    (folder,) = ipc_dirs(server.proc.pid)
    (address,) = glob.glob(f"{folder}/*-out")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{address}")
    for message in frames:
        push.send_multipart(message)
    push.close(linger=5000)
    ctx.term()


def test_malformed_output_frames_are_logged_and_dropped(
    server: KilnServer, client: openai.OpenAI, http: httpx.Client, model_name: str
) -> None:
    _send_to_output_socket(server, MALFORMED)
    for _ in range(2):  # before the fix, the reader died on the first frame: this hung
        completion = client.completions.create(
            model=model_name, prompt="Hello", max_tokens=3, timeout=30
        )
        assert completion.choices[0].finish_reason == "length"
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while server.output().count("dropped a malformed frame") < len(MALFORMED):
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.1)
