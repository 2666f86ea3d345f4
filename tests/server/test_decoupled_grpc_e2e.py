"""Decoupled models over gRPC, end to end: a real `edgeserve serve` on loopback and tritonclient's own
stream API (`start_stream` / `async_stream_infer`), as Triton's decoupled examples use it.

The models are the in-process stand-in (decoupled_stub.py: it stands in for the Python backend's
decoupled models until H1's land). Hostile cases: a never-final model and a client deadline, a client
that cancels mid-stream, 10^6 responses to a reader that stops reading (the server's buffer bound)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from decoupled_stub import start_stub_server, write_model
from es_server import RunningServer, wait_until
from stub_models import DECOUPLED_CONFIG, FLOOD, NEVER_FINAL, REPEAT, bounded
from tritonclient.utils import InferenceServerException

WAIT_S = 60.0  # generous: a loaded 2-core box; never reached when the code is right


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("decoupled-grpc")
    repo = tmp / "repo"
    write_model(repo, "repeat", DECOUPLED_CONFIG, REPEAT)
    write_model(repo, "never_final", DECOUPLED_CONFIG, NEVER_FINAL)
    write_model(repo, "flood", DECOUPLED_CONFIG + bounded(8, 1.0), FLOOD)
    running = start_stub_server(repo, tmp)
    yield running
    running.stop()


def _input(values: list[int]) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("IN", [len(values)], "INT32")
    inp.set_data_from_numpy(np.array(values, dtype=np.int32))
    return inp


def _done(server: RunningServer, model: str, request_id: str) -> str:
    path = server.repository / model / f"done-{request_id}"
    assert wait_until(path.exists, WAIT_S), server.log()[-3000:]
    return str(path.read_text())


def _final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def test_repeat_streams_each_response_in_order_then_the_empty_final(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("repeat", [_input([4, 5, 6])], request_id="r1",
                                  enable_empty_final_response=True)  # fmt: skip
        got = [results.get(timeout=WAIT_S) for _ in range(4)]
    finally:
        client.stop_stream()
        client.close()
    assert all(error is None for _, error in got)
    values = [int(r.as_numpy("OUT")[0]) for r, _ in got[:3]]
    assert values == [4, 5, 6] and [int(r.as_numpy("IDX")[0]) for r, _ in got[:3]] == [0, 1, 2]
    assert [_final(r) for r, _ in got] == [False, False, False, True]
    last = got[3][0].get_response()
    assert not last.outputs and last.id == "r1" and last.model_name == "repeat"


def test_without_the_empty_final_flag_only_the_responses_come(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("repeat", [_input([1, 2])], request_id="a")
        client.async_stream_infer("repeat", [_input([9])], request_id="b")
        assert _done(server, "repeat", "a") and _done(server, "repeat", "b")
        client.stop_stream()  # waits for what is pending: nothing more must come
    finally:
        client.close()
    got = []
    while not results.empty():
        got.append(results.get())
    by_id: dict[str, list[int]] = {}
    for result, error in got:
        assert error is None and not _final(result)
        by_id.setdefault(result.get_response().id, []).append(int(result.as_numpy("OUT")[0]))
    assert by_id == {"a": [1, 2], "b": [9]}


def test_unary_infer_of_a_decoupled_model_gets_tritons_error(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("repeat", [_input([1])])
    finally:
        client.close()
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(caught.value)
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"


def test_a_never_final_model_ends_at_the_clients_deadline_and_is_cancelled(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    # the stream's deadline: 3 s (short enough for a test; the request never ends by itself)
    client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=3)
    try:
        client.async_stream_infer("never_final", [_input([0])], request_id="nf")
        first, error = results.get(timeout=WAIT_S)
        assert error is None and int(first.as_numpy("OUT")[0]) == 1
        assert _done(server, "never_final", "nf") == "cancelled=True sent=1"
    finally:
        client.stop_stream()
        client.close()


def test_a_client_that_cancels_mid_stream_cancels_the_model(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("flood", [_input([1_000_000, 1])], request_id="gone")
        results.get(timeout=WAIT_S)
        client.stop_stream(cancel_requests=True)  # the RPC is cancelled: the client is gone
        report = _done(server, "flood", "gone")
    finally:
        client.close()
    assert report.startswith("cancelled=True")
    assert int(report.rpartition("=")[2]) < 1_000_000


def test_a_reader_that_stops_reading_bounds_the_servers_buffer(server: RunningServer) -> None:
    """10^6 responses of 64 KiB each to a client whose callback blocks after the first: the transport
    fills, the server's stream holds at most 8 (the model's bound), the model waits in send, and
    after 1 s without a read the request ends as cancelled: the model stopped long before 10^6."""
    stuck = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def callback(result: Any, error: Any) -> None:
        stuck.wait(WAIT_S * 2)  # tritonclient reads the stream on this thread: no more reads

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("flood", [_input([1_000_000, 16384])], request_id="slow")
        report = _done(server, "flood", "slow")
    finally:
        stuck.set()
        client.stop_stream(cancel_requests=True)
        client.close()
    assert report.startswith("cancelled=True")
    sent = int(report.rpartition("=")[2])
    # what HTTP/2 flow control lets through (a few MB of 64 KiB responses) plus the 8 buffered
    assert sent < 2_000, sent
    assert server.alive()
