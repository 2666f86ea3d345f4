"""The client's per-request fast path against a scripted ROUTER socket in this thread (no server):
memoised lookups give what the plain ones give, replies parse, bad replies stay clear errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq

from edgeserve.client import ClientError, FrameRing, ZmqClient
from edgeserve.frontends.zmq.spin import BACKOFF_WAITS, CoreShare
from edgeserve.protocol.errors import InferenceError

OK_OUT = [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4]}]


class Peer:
    """The server end: reads requests and sends what a test scripts."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.bind(endpoint)

    def take(self) -> tuple[bytes, dict[str, Any], list[bytes]]:
        ident, header, *frames = self.sock.recv_multipart()
        return ident, json.loads(header), frames

    def reply(self, ident: bytes, header: dict[str, Any], *frames: bytes) -> None:
        self.sock.send_multipart([ident, json.dumps({"v": 1, **header}).encode(), *frames])

    def answer_after(self, delays: list[float], output: np.ndarray) -> threading.Thread:
        """A thread answering one request per delay, each after sleeping that long."""

        def serve() -> None:
            for delay in delays:
                ident, request, _ = self.take()
                time.sleep(delay)
                self.reply(ident, {"id": request["id"], "status": "OK", "outputs": OK_OUT}, output.tobytes())

        thread = threading.Thread(target=serve)
        thread.start()
        return thread


@contextmanager
def connected(endpoint: str, **client_options: Any) -> Iterator[tuple[ZmqClient, Peer]]:
    ctx: zmq.Context[Any] = zmq.Context()
    peer = Peer(ctx, endpoint)
    client = ZmqClient(endpoint, timeout=5.0, context=ctx, **client_options)
    try:
        yield client, peer
    finally:
        # The answer to close()'s bye, queued ahead: this thread cannot answer while close() waits.
        peer.reply(client.identity, {"id": client._next_id, "status": "OK"})
        client.close()
        peer.sock.close(linger=0)
        ctx.term()


@pytest.fixture
def pair() -> Iterator[tuple[ZmqClient, Peer]]:
    with connected("inproc://fastpath") as both:
        yield both


def test_tensor_specs_are_the_same_memoised() -> None:
    with FrameRing(1, 4096) as ring:
        slot = ring.acquire()
        shapes: list[Any] = [(2, 3), [2, 3], (np.int64(2), 3), (2, 3)]
        for dtype in ("FP32", np.float32, np.dtype("<f4"), "float32", np.float32):
            for shape in shapes:
                ref = slot.tensor(shape, dtype)
                assert (ref.datatype, ref.shape, ref.byte_size) == ("FP32", (2, 3), 24)
                assert ref.shape is not None and all(type(d) is int for d in ref.shape)
                assert type(ref.byte_size) is int
        assert slot.tensor((5,), "INT64").byte_size == 40
        assert slot.tensor((5,), np.uint8).byte_size == 5
        assert slot.tensor((1, 2), "BYTES", byte_size=11).shape == (1, 2)
        for _ in range(2):  # a cached lookup must not hide the errors
            with pytest.raises(InferenceError, match="negative dimension"):
                slot.tensor((2, -1), np.float32)
            with pytest.raises(InferenceError, match="no fixed element size"):
                slot.tensor((2,), "BYTES")
            with pytest.raises(InferenceError, match="no protocol datatype"):
                slot.tensor((2,), np.dtype(">f4"))


def test_replies_parse_and_bad_ones_are_clear_errors(pair: tuple[ZmqClient, Peer]) -> None:
    client, peer = pair
    want = np.arange(4, dtype=np.float32).reshape(1, 4)
    cases: list[tuple[dict[str, Any], list[bytes], str | None]] = [
        ({"status": "OK", "model": "m", "version": "1", "outputs": OK_OUT}, [want.tobytes()], None),
        ({"status": "OK", "outputs": OK_OUT}, [want.tobytes()], None),  # the same spec, cached
        ({"status": "OK", "outputs": OK_OUT}, [b"\0" * 12], "got 12 bytes for shape [1, 4] of FP32"),
        ({"status": "OK", "outputs": OK_OUT}, [], "IndexError"),
        ({"status": "OK", "outputs": [{"name": "OUTPUT0", "shape": [4]}]}, [b"\0" * 16], "KeyError"),
        ({"status": "NOT_FOUND", "message": "no model 'm'"}, [], "no model 'm'"),
    ]
    for header, frames, error in cases:
        future = client.submit("m", {"INPUT0": np.zeros((1, 4), np.float32)})
        ident, request, _ = peer.take()
        assert request["op"] == "infer" and request["inputs"][0]["shape"] == [1, 4]
        peer.reply(ident, {"id": request["id"], **header}, *frames)
        if error is None:
            result = future.result()
            assert result.as_numpy("OUTPUT0").tolist() == want.tolist()
            assert result.latency_s > 0
        else:
            with pytest.raises(ClientError) as info:
                future.result()
            assert error in info.value.message
            assert info.value.status == ("NOT_FOUND" if "model" in error else "INTERNAL")


def test_frames_sent_one_by_one_arrive_whole(pair: tuple[ZmqClient, Peer]) -> None:
    client, peer = pair
    client.copy_inputs = False
    small = np.arange(8, dtype=np.int32)
    large = np.arange(70_000, dtype=np.uint8)  # >= 64 KB: sent without a copy
    future = client.submit("m", {"a": small, "b": large}, ["out"], priority=2, parameters={"k": "v"})
    ident, request, frames = peer.take()
    assert [d["name"] for d in request["inputs"]] == ["a", "b"]
    assert request["outputs"] == [{"name": "out"}]
    assert (request["priority"], request["parameters"]) == (2, {"k": "v"})
    assert frames == [small.tobytes(), large.tobytes()]
    peer.reply(ident, {"id": request["id"], "status": "OK", "outputs": []})
    assert future.result().outputs == {}


def test_pipelined_replies_in_any_order(pair: tuple[ZmqClient, Peer]) -> None:
    client, peer = pair
    peer.reply(client.identity, {"id": client._next_id, "status": "OK"})  # to the register
    ring = client.create_ring(slots=3, slot_size=64)
    assert peer.take()[1]["op"] == "register"
    futures = []
    for i in range(3):
        slot = ring.acquire()
        slot.ndarray((1, 4), np.float32)[:] = i
        futures.append(client.submit("m", {"INPUT0": slot.tensor((1, 4), np.float32)}))
    requests = [peer.take() for _ in range(3)]
    for ident, request, _ in reversed(requests):
        value = np.full((1, 4), request["inputs"][0]["shm"]["slot"], np.float32)
        peer.reply(ident, {"id": request["id"], "status": "OK", "outputs": OK_OUT}, value.tobytes())
    assert futures[1].result().as_numpy("OUTPUT0").tolist() == [[1.0] * 4]
    assert [f.result().as_numpy("OUTPUT0")[0, 0] for f in futures] == [0.0, 1.0, 2.0]
    assert ring.free == 3 and client.in_flight == 0


def test_a_short_deadline_after_long_ones_is_still_kept(pair: tuple[ZmqClient, Peer]) -> None:
    client, peer = pair
    future = client.submit("m", {"INPUT0": np.zeros((1, 4), np.float32)}, timeout=600.0)
    ident, request, _ = peer.take()
    peer.reply(ident, {"id": request["id"], "status": "OK", "outputs": []})
    future.result()  # the client now waits with a 600 s receive timeout
    start = time.monotonic()
    with pytest.raises(ClientError) as info:
        client.infer("m", {"INPUT0": np.zeros((1, 4), np.float32)}, timeout=0.2)
    waited = time.monotonic() - start
    assert info.value.status == "DEADLINE_EXCEEDED"
    assert 0.2 <= waited < 300  # never early; and not the 600 s of the earlier wait, however busy the box


def test_a_spinning_client_gets_early_and_late_replies_and_keeps_deadlines() -> None:
    want = np.arange(4, dtype=np.float32).reshape(1, 4)
    # A 10-minute spin: its end can never be mistaken for the deadline's, however busy the box.
    with connected("inproc://spin", spin_us=600_000_000) as (client, peer):
        server = peer.answer_after([0.0, 0.05], want)
        for _ in range(2):  # answered at once (within the spin), then after 50 ms
            result = client.infer("m", {"INPUT0": np.zeros((1, 4), np.float32)})
            assert result.as_numpy("OUTPUT0").tolist() == want.tolist()
        server.join(5)
        start = time.monotonic()
        with pytest.raises(ClientError) as info:  # nobody answers: the spin stops at the deadline
            client.infer("m", {"INPUT0": np.zeros((1, 4), np.float32)}, timeout=0.1)
        assert info.value.status == "DEADLINE_EXCEEDED"
        assert 0.1 <= time.monotonic() - start < 300  # never early, and not the 600 s spin
        peer.take()


def test_spinning_turns_off_while_replies_are_slow_and_back_on_when_they_are_fast() -> None:
    """Whether it spins follows the reply times it measured (each result's latency_s): checked
    against them, not against how fast this box answers. Slow replies are slow on any box."""
    want = np.arange(4, dtype=np.float32).reshape(1, 4)
    with connected("inproc://adaptive", spin_us=5_000) as (client, peer):
        client._core = CoreShare(time.monotonic)  # its core all the time: only reply times decide
        average = 0.0  # the client's moving average of reply times, replayed from the results

        def run(delays: list[float]) -> None:
            nonlocal average
            server = peer.answer_after(delays, want)
            for _ in delays:
                result = client.infer("m", {"INPUT0": np.zeros((1, 4), np.float32)})
                assert result.as_numpy("OUTPUT0").tolist() == want.tolist()
                average += (result.latency_s - average) * 0.125
                assert client.spinning == (average <= client.spin_s)
            server.join(10)

        assert client.spinning  # nothing measured yet: try it
        run([0.1] * 4)  # 100 ms replies at least: far beyond the 5 ms window
        assert not client.spinning
        run([0.0] * 60)  # prompt replies bring it back (as soon as their average is within 5 ms)


def test_a_client_that_does_not_get_its_core_while_spinning_sleeps_then_tries_again() -> None:
    """The CPU clock is injected: while it stands still (other processes have the core) a few spins
    turn spinning off; after the back-off's waits the client spins again, and goes on while the
    core is its own."""
    want = np.arange(4, dtype=np.float32).reshape(1, 4)
    busy_core = [0.0]
    # A 10-minute window: replies, however late on a busy box, are within it; only the core decides.
    with connected("inproc://core-share", spin_us=600_000_000) as (client, peer):
        client._core = CoreShare(lambda: busy_core[0])  # no CPU time at all while spinning

        made = [0]

        def call() -> None:
            result = client.infer("m", {"INPUT0": np.zeros((1, 4), np.float32)})
            assert result.as_numpy("OUTPUT0").tolist() == want.tolist()
            made[0] += 1

        answers = 8 + BACKOFF_WAITS + 8
        server = peer.answer_after([0.002] * answers, want)  # each spin lasts 2 ms
        spins = 0
        while client.spinning:
            call()
            spins += 1
            assert spins < 8, "kept spinning on a core it did not get"
        for _ in range(BACKOFF_WAITS):  # every wait sleeps at once
            call()
        assert client.spinning
        client._core.cpu_clock = time.monotonic  # the core is free again: CPU time = wall time
        for _ in range(8):
            call()
            assert client.spinning
        while made[0] < answers:
            call()
        server.join(10)


def test_spin_us_zero_never_spins() -> None:
    client = ZmqClient("inproc://never-spins", timeout=1.0, context=zmq.Context.instance(), spin_us=0)
    try:
        assert not client.spinning
    finally:
        assert client._sock is not None
        client._sock.close(linger=0)  # nothing listens: skip close()'s bye
        client._sock = None
