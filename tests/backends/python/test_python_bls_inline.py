"""A BLS call answered on the server's event reader thread (server/bls.py runs a quick idle model
inline, issue 35's one-hop cost): the answer arrives once, nothing stays registered, and a result
that finds the server's half full does not block the reader (the frees that make room come through
it). Real event channels (a socketpair and a memfd, as a worker has) and the real DataPlane over the
in-memory repository of tests/fake_plane.py."""

from __future__ import annotations

import gc
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_plane import FakeRepository, fake_plane

from edgeserve.backends import streams
from edgeserve.backends.python import channel, wire
from edgeserve.backends.python.events import Events
from edgeserve.server.bls import DataPlaneCaller

WAIT_S = 30.0  # generous (a loaded 2-core box); the blocked-reader bug would answer after ALLOC_WAIT_S (60 s)
ADD = """
max_batch_size: 0
input { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }
output { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] }
"""


@pytest.fixture()
def link(tmp_path: Path) -> Iterator[tuple[channel.Channel, Events, list[str]]]:
    threads: list[str] = []  # where the model ran
    repo = FakeRepository(tmp_path)

    def double(inputs: dict[str, Any]) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return {"SUM": inputs["A"] * 2}

    repo.add("double", ADD, double)
    repo.models["double"].scheduler.inline = True
    streams.install_caller(DataPlaneCaller(fake_plane(repo)))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = wire.create_region_fd("test-inline", 2 * channel.HALF)  # sparse, as the worker's
    worker = channel.Channel(ours, wire.Region(os.dup(fd)), "worker", "model")
    server = channel.Channel(theirs, wire.Region(fd), "server", "label")
    events = Events(server, "caller", "label")
    worker.start()
    try:
        yield worker, events, threads
    finally:
        streams.install_caller(None)
        worker.close()
        server.close()
        repo.close()


def _bls(worker: channel.Channel) -> wire.Header:
    headers, _ = worker.write([("A", np.arange(4, dtype=np.float32))])
    message = {"op": "bls", "model": "double", "inputs": headers, "outputs": ["SUM"]}
    return worker.call(message, WAIT_S)


def test_a_quick_model_answers_on_the_reader_thread_and_nothing_stays_registered(link: Any) -> None:
    worker, events, threads = link
    answer = _bls(worker)
    assert "error" not in answer, answer
    out = worker.read(answer["outputs"], copy=True)
    np.testing.assert_array_equal(out["SUM"], np.arange(4, dtype=np.float32) * 2)
    assert threads == ["edgeserve-events-label"]  # inline: no hop to a scheduler thread
    assert not events._calls  # a call answered before `call` returned is not kept as in flight


def test_a_full_half_hands_the_answer_over_and_the_reader_still_takes_frees(link: Any) -> None:
    worker, events, threads = link
    arena = events.channel.arena
    filler = arena.alloc(channel.HALF - 4096)  # what a model still holds of earlier results
    arena.alloc(4096)  # the half is full now: the 16-byte SUM has no room
    got: list[wire.Header] = []
    done = threading.Event()
    headers, _ = worker.write([("A", np.arange(4, dtype=np.float32))])

    def answered(answer: wire.Header) -> None:
        got.append(answer)
        done.set()

    worker.ask({"op": "bls", "model": "double", "inputs": headers, "outputs": ["SUM"]}, answered)
    assert not done.wait(0.2)  # waiting for room (on a thread of its own, not the reader)
    worker.post({"op": "free", "o": filler})  # the reader must be free to take this
    assert done.wait(WAIT_S)
    assert "error" not in got[0], got[0]
    np.testing.assert_array_equal(worker.read(got[0]["outputs"], copy=True)["SUM"],
                                  np.arange(4, dtype=np.float32) * 2)  # fmt: skip
    assert threads == ["edgeserve-events-label"]


def test_a_result_held_as_views_goes_back_with_the_next_message_once_dropped(link: Any) -> None:
    worker, events, _ = link
    arena = events.channel.arena
    first = _bls(worker)
    held = worker.read_held(first["outputs"], first["block"])  # no copy: views into the server's half
    np.testing.assert_array_equal(held["SUM"], np.arange(4, dtype=np.float32) * 2)
    one = arena.in_use()
    kept = held["SUM"][1:]  # a view of the view still holds the block
    del held
    gc.collect()
    second = _bls(worker)  # its message has nothing to free yet
    assert arena.in_use() == 2 * one
    worker.read_held(second["outputs"], second["block"])  # dropped at once
    del kept
    gc.collect()
    _bls(worker)  # carries the frees of both blocks: only its own result is out
    assert arena.in_use() == one
