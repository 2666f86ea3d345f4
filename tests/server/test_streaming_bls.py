"""The data plane's response stream (server/streaming.py: order, the buffer bound, a stuck reader
cancelled) and BLS calls (server/bls.py: DataPlaneCaller through the real DataPlane over the
in-memory repository of tests/fake_plane.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from fake_plane import FakeRepository, fake_plane

from edgeserve.backends import streams
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InferResponse, InputTensor
from edgeserve.server.bls import DataPlaneCaller
from edgeserve.server.streaming import ResponseStream

WAIT_S = 60.0  # generous upper bound (a loaded 2-core box); never reached when the code is right
MANY = 100_000  # the 10^6 flood is the gRPC e2e test (test_decoupled_grpc_e2e.py); CPU is shared


def test_many_responses_to_a_reader_never_exceed_the_bound() -> None:
    """The reader wakes on notify and takes what is there; the producer is held at 16 whenever the
    reader lags (thread switches on a loaded box make it lag often)."""
    ready = threading.Event()
    stream = ResponseStream(lambda s: ready.set(), capacity=16, stall_s=WAIT_S)
    got: list[int] = []

    def reader() -> None:
        while True:
            ready.wait(WAIT_S)
            ready.clear()
            items = stream.take()
            got.extend(-1 if final else int(value) for value, final in items)  # type: ignore[call-overload]
            if items and items[-1][1]:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    for index in range(MANY):
        assert stream.put(index, False)  # type: ignore[arg-type]
    stream.put(None, True)
    thread.join(WAIT_S)
    assert got[:-1] == list(range(MANY)) and got[-1] == -1
    assert stream.peak <= 16 + 1  # the bound, plus the one final item allowed past it
    assert not stream.cancelled


def test_a_stuck_reader_ends_the_request_as_cancelled() -> None:
    cancelled = threading.Event()
    stream = ResponseStream(lambda s: None, capacity=2, stall_s=0.2)
    stream.on_cancel(cancelled.set)
    assert stream.put(None, False) and stream.put(None, False)
    assert not stream.put(None, False)  # nobody reads: waits 0.2 s, then gives up
    assert stream.cancelled and cancelled.is_set()
    assert not stream.put(None, False)  # dropped at once from now on
    items = stream.take()
    error, final = items[-1]
    assert final and isinstance(error, InferenceError) and error.status is Status.CANCELLED
    assert len(items) == 3


def test_a_reader_that_cancels_releases_a_waiting_model() -> None:
    stream = ResponseStream(lambda s: None, capacity=1, stall_s=WAIT_S)
    stream.put(None, False)
    outcome: list[bool] = []
    sender = threading.Thread(target=lambda: outcome.append(stream.put(None, False)))
    sender.start()
    stream.cancel()
    sender.join(WAIT_S)
    assert outcome == [False] and stream.take() == []


ADD = """
max_batch_size: 0
input { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }
output { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] }
"""


def _request(model: str) -> InferRequest:
    data = np.arange(4, dtype=np.float32)
    return InferRequest(model, inputs=[InputTensor("A", "FP32", (4,), data)])


def _call(plane_caller: DataPlaneCaller, request: InferRequest, **kwargs: Any) -> list[tuple[Any, bool]]:
    results: list[tuple[Any, bool]] = []
    done = threading.Event()

    def on_result(result: Any, final: bool) -> None:
        results.append((result, final))
        if final:
            done.set()

    plane_caller.call(request, on_result, **kwargs)
    assert done.wait(WAIT_S)
    return results


def test_a_bls_call_goes_through_the_data_plane_and_answers_once(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("double", ADD, lambda x: {"SUM": x["A"] * 2})
    plane = fake_plane(repo)
    try:
        streams.install_caller(DataPlaneCaller(plane))
        caller = streams.current_caller()
        assert isinstance(caller, DataPlaneCaller)
        ((response, final),) = _call(caller, _request("double"), caller="pre")
        assert final and isinstance(response, InferResponse)
        np.testing.assert_array_equal(response.as_numpy("SUM"), np.arange(4, dtype=np.float32) * 2)
        assert len(repo.models["double"].scheduler.jobs) == 1  # it reached the model's scheduler
        assert plane.inflight == 0
    finally:
        streams.install_caller(None)
        repo.close()
    assert streams.current_caller() is None


def test_a_bls_call_to_a_missing_model_is_an_error_naming_it(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    try:
        ((error, final),) = _call(DataPlaneCaller(fake_plane(repo)), _request("nowhere"))
    finally:
        repo.close()
    assert final and isinstance(error, InferenceError) and error.status is Status.NOT_FOUND
    # Triton's BLS words (its bls example prints them)
    assert error.message == "Failed for execute the inference request. Model 'nowhere' is not ready."


def test_a_single_instance_model_calling_itself_is_refused_not_deadlocked(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("loop", ADD, lambda x: {"SUM": x["A"]})
    try:
        ((error, final),) = _call(DataPlaneCaller(fake_plane(repo)), _request("loop"), caller="loop")
    finally:
        repo.close()
    assert final and isinstance(error, InferenceError) and error.status is Status.INVALID_ARG
    assert "to itself" in error.message and not repo.models["loop"].scheduler.jobs
