"""The lane (edgeserve/frontends/zmq/lane.py): a ring client's requests and replies over a Unix
SEQPACKET socket past libzmq's I/O threads, with ZeroMQ for everything that does not fit or was not
asked on the lane. Real frontend, real sockets, real shared memory (conftest's `server`)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import wait_until
from zmq_harness import RunningFrontend, identity_model, running_frontend

from edgeserve.client import ClientError, ZmqClient
from edgeserve.frontends.zmq.lane import FRAMES_MAX, PACKET_MAX, Lane, Lanes, decode, encode

WAIT_S = 30.0  # generous: a busy 2-vCPU CI box


def _lanes(server: RunningFrontend) -> Lanes:
    lanes = server.frontend._lanes
    assert lanes is not None, "an ipc:// frontend with peer credentials offers lanes"
    return lanes


def _on_router(server: RunningFrontend, fn: Callable[[], Any]) -> None:
    """Run `fn` on the ROUTER thread (where lanes are served) and wait for it."""
    router = server.frontend._router
    assert router is not None
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()

    router.call_soon(run)
    assert done.wait(WAIT_S)


def test_packets_round_trip_and_refuse_what_does_not_fit() -> None:
    frames = [b'{"v":1}', b"", np.arange(10, dtype=np.float32)]
    buffers = encode(frames)
    assert buffers is not None
    packet = memoryview(b"".join(bytes(memoryview(b)) for b in buffers))
    assert [bytes(f) for f in decode(packet)] == [bytes(memoryview(f)) for f in frames]
    assert encode([bytes(PACKET_MAX)]) is None  # over ZeroMQ instead
    most = [bytes([i]) * i for i in range(FRAMES_MAX)]  # the head of each frame count is packed at once
    buffers = encode(most)
    assert buffers is not None and encode([*most, b""]) is None
    packet = memoryview(b"".join(bytes(memoryview(b)) for b in buffers))
    assert [bytes(f) for f in decode(packet)] == most
    with pytest.raises(ValueError):
        decode(memoryview(struct.pack("<H", FRAMES_MAX + 1) + bytes(4 * (FRAMES_MAX + 1))))
    for bad in (b"", b"\x00\x00", b"\x01\x00\x05\x00\x00\x00ab", packet.tobytes() + b"x"):
        with pytest.raises(ValueError):
            decode(memoryview(bad))


def test_a_ring_client_talks_over_its_lane_and_gets_the_same_answers(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S) as client:
        assert not client.lane_open  # only a ring client asks for one
        ring = client.create_ring(slots=4, slot_size=4096)
        assert client.lane_open
        before = lanes.requests
        for i in range(20):
            x = np.full((1, 256), i, np.float32)
            result = client.infer("id_fp32", {"INPUT0": ring.acquire().write(x)})
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        assert lanes.requests == before + 20
        assert client.ping()["server"] == "edgeserve"  # control goes over ZeroMQ as ever
        assert [r["name"] for r in client.regions() if r["mine"]] == [ring.name]
        # pipelined, ring and inline requests mixed: every future finishes with its own answer
        futures = {}
        for i in range(8):
            x = np.full((1, 64), i, np.float32)
            value: Any = ring.acquire().write(x) if i % 2 else x
            futures[i] = (client.submit("id_fp32", {"INPUT0": value}), x)  # 4 ring slots: enough
        for future, x in futures.values():
            np.testing.assert_array_equal(future.result().as_numpy("OUTPUT0"), x)
    assert not client.lane_open


def test_a_reply_too_big_for_a_packet_comes_over_zeromq(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S) as client:
        big = np.arange(PACKET_MAX // 4 + 1000, dtype=np.float32).reshape(1, -1)
        ring = client.create_ring(slots=2, slot_size=big.nbytes)
        before = lanes.requests
        result = client.infer("id_fp32", {"INPUT0": ring.acquire().write(big)})  # asked on the lane
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), big)
        assert lanes.requests == before + 1
        inline = client.infer("id_fp32", {"INPUT0": big})  # too big for a packet: ZeroMQ both ways
        np.testing.assert_array_equal(inline.as_numpy("OUTPUT0"), big)
        assert lanes.requests == before + 1 and client.lane_open


def test_lane_false_keeps_everything_on_zeromq(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S, lane=False) as client:
        ring = client.create_ring(slots=2, slot_size=4096)
        before = lanes.requests
        x = np.ones((1, 16), np.float32)
        np.testing.assert_array_equal(
            client.infer("id_fp32", {"INPUT0": ring.acquire().write(x)}).as_numpy("OUTPUT0"), x
        )
        assert not client.lane_open and lanes.requests == before


def test_a_lane_the_server_closes_leaves_the_client_on_zeromq(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S) as client:
        ring = client.create_ring(slots=2, slot_size=4096)
        assert client.lane_open
        _on_router(server, lambda: lanes.drop(client.identity))
        for i in range(3):  # the first send or read finds the lane gone; every request is answered
            x = np.full((1, 16), i, np.float32)
            np.testing.assert_array_equal(
                client.infer("id_fp32", {"INPUT0": ring.acquire().write(x)}).as_numpy("OUTPUT0"), x
            )
        assert not client.lane_open
        assert lanes.open == 0 or all(lane.ident != client.identity for lane in lanes._lanes.values())


def test_without_ipc_there_is_no_lane_and_nothing_changes(tcp_server: RunningFrontend) -> None:
    assert tcp_server.frontend._lanes is None
    with ZmqClient(tcp_server.endpoint, timeout=WAIT_S) as client:
        ring = client.create_ring(slots=2, slot_size=4096)
        x = np.ones((1, 8), np.float32)
        np.testing.assert_array_equal(
            client.infer("id_fp32", {"INPUT0": ring.acquire().write(x)}).as_numpy("OUTPUT0"), x
        )
        assert not client.lane_open


def test_after_a_server_restart_the_client_gets_a_new_lane(sockdir: Path) -> None:
    endpoint = f"ipc://{sockdir}/lane-restart.zmq"
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    with running_frontend([identity_model("m", "FP32")], endpoint) as first:
        client = ZmqClient(first.endpoint, timeout=5.0)
        ring = client.create_ring(slots=2, slot_size=64)
        assert client.lane_open
    try:
        with running_frontend([identity_model("m", "FP32")], endpoint) as second:
            assert wait_until(lambda: _answers(client))  # the old lane is found closed meanwhile
            assert not client.lane_open
            with pytest.raises(ClientError):  # NOT_FOUND: a new server, an empty registry
                client.infer("m", {"INPUT0": ring.acquire().write(x)})
            before = _lanes(second).requests
            np.testing.assert_array_equal(  # registers the ring again, opens a new lane, answered there
                client.infer("m", {"INPUT0": ring.acquire().write(x)}).as_numpy("OUTPUT0"), x
            )
            assert client.lane_open and _lanes(second).requests == before + 1
            client.close()
    finally:
        client.close()


def _answers(client: ZmqClient) -> bool:
    try:
        return client.ping(timeout=0.5)["status"] == "OK"
    except ClientError:
        return False


@pytest.fixture(scope="module")
def tcp_server() -> Any:
    with running_frontend([identity_model("id_fp32", "FP32")], "tcp://127.0.0.1:*") as running:
        yield running


def test_a_lane_carries_only_replies_to_what_was_asked_on_it() -> None:
    """The frontend hands the lane the header it parsed (no second parse) and, with a reply, the id
    that reply answers: only an id asked on the lane (not a streamed one) goes back over it, once."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        lane = Lane(ours)
        lane.asked({"v": 1, "op": "infer", "id": 7})
        lane.asked({"v": 1, "op": "infer", "id": 8, "stream": True})  # its replies: ZeroMQ
        lane.asked({"v": 1, "op": "infer", "id": True})  # not an id
        lane.asked(["not", "a", "header"])
        assert lane.ids == {7}
        assert not lane.reply([b'{"v":1,"id":7}'], 8)
        assert lane.reply([b"the header is not read when the id is given"], 7)
        assert [bytes(f) for f in decode(memoryview(theirs.recv(PACKET_MAX)))] == [
            b"the header is not read when the id is given"
        ]
        assert not lane.reply([b'{"v":1,"id":7}'], 7)  # answered already
        lane.asked({"v": 1, "id": "abc"})
        assert not lane.reply([b"not json"])  # no id given: read from the header
        assert lane.reply([b'{"v":1,"id":"abc","status":"OK"}'])
        assert bytes(decode(memoryview(theirs.recv(PACKET_MAX)))[0]) == b'{"v":1,"id":"abc","status":"OK"}'


def test_a_client_that_does_not_spin_waits_before_it_looks(
    sockdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without spinning, a wait for a reply polls first (it returns at once for a reply already
    there) and reads the lane once, for that reply: no failed read before the wait. (A server of its
    own: another client's disconnect would send this one a probe over ZeroMQ, which wakes it too.)"""
    with (
        running_frontend([identity_model("m", "FP32")], f"ipc://{sockdir}/lane-wait.zmq") as server,
        ZmqClient(server.endpoint, timeout=WAIT_S, spin_us=0) as client,
    ):
        ring = client.create_ring(slots=2, slot_size=4096)
        lane = client._link.lane
        assert lane is not None
        reads: list[bool] = []
        recv = lane.recv

        def counted() -> list[Any] | None:
            msg = recv()
            reads.append(msg is not None)
            return msg

        monkeypatch.setattr(lane, "recv", counted)
        for i in range(5):
            x = np.full((1, 32), i, np.float32)
            result = client.infer("m", {"INPUT0": ring.acquire().write(x)})
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        assert reads == [True] * 5
        future = client.submit("m", {"INPUT0": ring.acquire().write(np.ones((1, 8), np.float32))})
        assert wait_until(lambda: server.frontend.counters()["inflight"] == 0)  # the reply is there
        reads.clear()
        assert future.result().as_numpy("OUTPUT0").tolist() == [[1.0] * 8]
        assert reads == [True]
