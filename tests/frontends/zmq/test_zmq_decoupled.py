"""Decoupled models over ZeroMQ, end to end: a real `edgeserve serve` (tests/es_server.py) with real
decoupled Python models (our own model.py files, in the pattern of Triton's "repeat" example, run by
the Python backend's worker process), and edgeserve.client's `infer_stream` or a raw DEALER socket
speaking the wire format of docs/zmq.md ("stream": true, one reply per response, "final").

Hostile cases: a model that never sends the final flag (the request's deadline, or the client's,
ends it and the model sees it cancelled), a client that cancels mid-stream or disappears, and 10^6
responses to a client that stops reading (the server holds a bounded number: checked by count)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from es_server import RunningServer, scrape, start_server, wait_until

from edgeserve.client import AsyncZmqClient, ClientError, ZmqClient
from edgeserve.frontends.zmq import wire

pytestmark = pytest.mark.timeout(300)
WAIT_S = 120.0  # generous: a worker process starts on a loaded 2-core box; never reached when right

# Triton's "repeat" pattern: one response per element of IN, from a thread of the model, after
# execute returned; then the final flag alone. IN = [] gives no response, only the final flag.
REPEAT = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            threading.Thread(target=self.repeat, args=(values, sender), daemon=True).start()
        return None

    def repeat(self, values, sender):
        for index, value in enumerate(values):
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([value], np.int32)),
                pb_utils.Tensor("IDX", np.array([index], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# IN = [total, size]: up to `total` responses of `size` int32 each until cancelled; the model then
# writes "cancelled=<bool> sent=<n>" to done-<request id> in its folder (what the tests read).
FLOOD = """
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]

    def execute(self, requests):
        for request in requests:
            total, size = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "IN").as_numpy())
            threading.Thread(target=self.flood, args=(request, total, size), daemon=True).start()
        return None

    def flood(self, request, total, size):
        sender = request.get_response_sender()
        out = pb_utils.Tensor("OUT", np.full([size], 7, np.int32))
        sent = 0
        while sent < total and not request.is_cancelled():
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sent += 1
        cancelled = request.is_cancelled()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with open(os.path.join(self.folder, "done-" + request.request_id()), "w") as f:
            f.write(f"cancelled={cancelled} sent={sent}")
"""

# One response, then nothing (never the final flag) until it sees the request cancelled.
NEVER_FINAL = """
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.hang, args=(request,), daemon=True).start()
        return None

    def hang(self, request):
        request.get_response_sender().send(
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([1], np.int32))]))
        while not request.is_cancelled():
            time.sleep(0.01)  # as a model checks between steps
        with open(os.path.join(self.folder, "done-" + request.request_id()), "w") as f:
            f.write("cancelled=True sent=1")
"""

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [{{ name: "IN", data_type: TYPE_INT32, dims: [-1] }}]
output [{outputs}]
instance_group [{{ kind: KIND_CPU, count: 1 }}]
{extra}"""
OUT_ONE = '{ name: "OUT", data_type: TYPE_INT32, dims: [1] }'
OUT_ANY = '{ name: "OUT", data_type: TYPE_INT32, dims: [-1] }'
IDX = '{ name: "IDX", data_type: TYPE_INT32, dims: [1] }'
STREAM_CAPACITY = 8  # the flood model's response stream bound, and its stall timeout below
BOUNDED = (f'parameters {{ key: "stream_buffer_responses" value {{ string_value: "{STREAM_CAPACITY}" }} }}\n'
           'parameters { key: "stream_stall_timeout_s" value { string_value: "1.0" } }\n')  # fmt: skip


def _write(repo: Path, name: str, source: str, outputs: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, outputs=outputs, extra=extra))
    (repo / name / "1" / "model.py").write_text(source)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("zdc")
    repo = tmp / "repo"
    _write(repo, "repeat", REPEAT, f"{OUT_ONE}, {IDX}")
    _write(repo, "flood", FLOOD, OUT_ANY, BOUNDED)
    _write(repo, "never_final", NEVER_FINAL, OUT_ONE)
    running = start_server(repo, tmp, timeout=WAIT_S)
    yield running
    running.stop()


def _done(server: RunningServer, model: str, request_id: Any) -> tuple[bool, int]:
    """What the model wrote when its request ended: (saw it cancelled, responses sent)."""
    path = server.repository / model / f"done-{request_id}"
    assert wait_until(path.exists, WAIT_S), server.log()[-3000:]
    cancelled, sent = (part.partition("=")[2] for part in path.read_text().split())
    return cancelled == "True", int(sent)


def _ints(values: list[int]) -> dict[str, Any]:
    return {"IN": np.array(values, dtype=np.int32)}


class _Raw:
    """A DEALER socket speaking the wire format by hand, as a client in another language would."""

    def __init__(self, server: RunningServer) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        self.sock.connect(server.zmq_endpoint)

    def send(self, header: dict[str, Any], *frames: bytes) -> None:
        self.sock.send_multipart([wire.dumps({"v": 1, **header}), *frames])

    def recv(self) -> tuple[dict[str, Any], list[bytes]]:
        while True:
            first, *frames = self.sock.recv_multipart()
            header = wire.loads(first)
            if header.get("op") != wire.OP_PROBE:
                return header, frames

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _infer_header(req_id: Any, model: str, values: list[int]) -> dict[str, Any]:
    return {"op": "infer", "id": req_id, "model": model, "stream": True,
            "inputs": [{"name": "IN", "datatype": "INT32", "shape": [len(values)]}]}  # fmt: skip


def test_repeat_streams_each_response_in_order_and_stops_at_the_final(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
        got = list(client.infer_stream("repeat", _ints([4, 5, 6, 7])))
    assert [int(r.as_numpy("OUT")[0]) for r in got] == [4, 5, 6, 7]
    assert [int(r.as_numpy("IDX")[0]) for r in got] == [0, 1, 2, 3]
    assert all(r.model_name == "repeat" for r in got)


def test_the_wire_format_marks_every_reply_and_ends_with_an_empty_final(server: RunningServer) -> None:
    raw = _Raw(server)
    try:
        raw.send(_infer_header(31, "repeat", [8, 9]), np.array([8, 9], np.int32).tobytes())
        replies = [raw.recv() for _ in range(3)]
    finally:
        raw.close()
    for (header, frames), value in zip(replies[:2], (8, 9), strict=True):
        assert header["id"] == 31 and header["status"] == "OK" and header["final"] is False
        assert [o["name"] for o in header["outputs"]] == ["OUT", "IDX"] and len(frames) == 2
        assert np.frombuffer(frames[0], np.int32).tolist() == [value]
    final, frames = replies[2]
    assert final == {"v": 1, "id": 31, "status": "OK", "model": "repeat", "version": final["version"],
                     "outputs": [], "final": True} and frames == []  # fmt: skip


def test_zero_responses_end_the_iteration_at_once(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
        assert list(client.infer_stream("repeat", _ints([]))) == []
        assert client.ping()["ready"]  # the client goes on as usual


def test_unary_infer_of_a_decoupled_model_raises_the_servers_error(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client, pytest.raises(ClientError) as caught:
        client.infer("repeat", _ints([1]))
    assert caught.value.status == "UNSUPPORTED"
    assert "doesn't support models with decoupled transaction policy" in caught.value.message


def test_a_client_that_cancels_mid_stream_cancels_the_model(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
        with client.infer_stream("flood", _ints([1_000_000, 1])) as stream:
            first = next(stream)
            request_id = stream.id
        assert first.as_numpy("OUT").tolist() == [7]
        assert list(stream) == []  # nothing more after the cancel
        cancelled, sent = _done(server, "flood", request_id)
        assert client.ping()["ready"]
    assert cancelled and sent < 1_000_000


def test_a_cancel_message_gets_one_final_cancelled_reply(server: RunningServer) -> None:
    raw = _Raw(server)
    try:
        raw.send(_infer_header("c1", "flood", [1_000_000, 1]), np.array([1_000_000, 1], np.int32).tobytes())
        header, _ = raw.recv()
        assert header["final"] is False
        raw.send({"op": "cancel", "id": "c1"})
        while not header.get("final"):
            header, _ = raw.recv()
        assert header["status"] == "CANCELLED" and header["id"] == "c1"
        cancelled, sent = _done(server, "flood", "c1")
        raw.send({"op": "ping", "id": 2})  # the same socket goes on; a late cancel is ignored
        raw.send({"op": "cancel", "id": "c1"})
        assert raw.recv()[0]["id"] == 2
    finally:
        raw.close()
    assert cancelled and sent < 1_000_000


def test_a_never_final_model_ends_at_the_requests_deadline_and_is_cancelled(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
        # timeout_us: the server's deadline for the request (2 s: the model would run forever)
        stream = client.infer_stream("never_final", _ints([0]), timeout_us=2_000_000)
        assert next(stream).as_numpy("OUT").tolist() == [1]
        with pytest.raises(ClientError) as caught:
            next(stream)
        assert _done(server, "never_final", stream.id) == (True, 1)
    assert caught.value.status != "OK"


def test_a_never_final_model_ends_at_the_clients_deadline_and_is_cancelled(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
        stream = client.infer_stream("never_final", _ints([0]), timeout=2.0)  # per response
        assert next(stream).as_numpy("OUT").tolist() == [1]
        with pytest.raises(ClientError) as caught:
            next(stream)
        assert caught.value.status == "DEADLINE_EXCEEDED"
        assert _done(server, "never_final", stream.id) == (True, 1)  # the client sent the cancel


def test_a_client_that_disappears_mid_stream_cancels_the_model(server: RunningServer) -> None:
    raw = _Raw(server)
    try:
        raw.send(_infer_header("gone", "flood", [1_000_000, 1]), np.array([1_000_000, 1], np.int32).tobytes())
        assert raw.recv()[0]["final"] is False
    finally:
        raw.close()  # the process's socket is gone: no cancel, no bye
    cancelled, sent = _done(server, "flood", "gone")
    assert cancelled and sent < 1_000_000
    assert server.alive()


def test_a_flood_to_a_client_that_stops_reading_is_bounded(server: RunningServer) -> None:
    """10^6 responses of 16 KiB to a client that reads none: ZeroMQ's queues fill (the server's
    SNDHWM of 1000 replies, the client's RCVHWM of 1000, the sockets' kernel buffers), then the
    server's stream (8) and the model waits in send; 1 s without a read ends the request as
    cancelled. The model stops at that bound, whatever the box's speed: memory never grows past it."""
    raw = _Raw(server)
    size = 4096
    try:
        raw.send(
            _infer_header("slow", "flood", [1_000_000, size]), np.array([1_000_000, size], np.int32).tobytes()
        )
        cancelled, sent = _done(server, "flood", "slow")
    finally:
        raw.close()
    assert cancelled
    sndhwm, rcvhwm = 1000, 1000  # the frontend's max(1000, 2 * max_inflight_per_client); libzmq's default
    kernel = 64  # 16 KiB replies in the ipc socket's kernel buffers (a few hundred KiB), generously
    assert sent <= sndhwm + rcvhwm + 2 * (STREAM_CAPACITY + 1) + kernel, sent
    assert server.alive()
    # nothing left behind: the request is over in the server too (no reply kept for the gone client)
    inflight = "edgeserve_zmq_inflight"
    assert wait_until(lambda: scrape(server.base, inflight) == {inflight: 0.0}, WAIT_S)


def test_the_async_client_streams_and_cancels(server: RunningServer) -> None:
    async def run() -> tuple[list[int], list[int], Any]:
        async with AsyncZmqClient(server.zmq_endpoint, timeout=WAIT_S) as client:
            values = [
                int(r.as_numpy("OUT")[0]) async for r in client.infer_stream("repeat", _ints([3, 2, 1]))
            ]
            empty = [int(r.as_numpy("OUT")[0]) async for r in client.infer_stream("repeat", _ints([]))]
            async with client.infer_stream("flood", _ints([1_000_000, 1])) as stream:
                await stream.__anext__()
            assert await client.ping()
            return values, empty, stream.id

    values, empty, request_id = asyncio.run(run())
    assert values == [3, 2, 1] and empty == []
    cancelled, sent = _done(server, "flood", request_id)
    assert cancelled and sent < 1_000_000
