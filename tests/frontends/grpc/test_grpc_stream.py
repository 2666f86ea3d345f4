"""ModelStreamInfer on the in-process frontend: ordering, errors, half-close, cancel, backpressure."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from es_server import wait_until
from grpc_fakes import Client, Inproc
from tritonclient.grpc import service_pb2


def delay_input(ms: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("DELAY_MS", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[ms]], dtype=np.int32))
    return [tensor]


def add_sub_inputs(value: int, batch: int = 1) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [batch, 16], "INT32")
        tensor.set_data_from_numpy(np.full((batch, 16), value, dtype=np.int32))
        inputs.append(tensor)
    return inputs


class Collector:
    def __init__(self) -> None:
        self.items: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def __call__(self, result: Any, error: Any) -> None:
        self.items.put((result, error))

    def take(self, n: int, timeout: float = 30.0) -> list[tuple[Any, Any]]:
        return [self.items.get(timeout=timeout) for _ in range(n)]


def test_responses_come_in_completion_order(client: Client) -> None:
    collect = Collector()
    client.start_stream(callback=collect)
    client.async_stream_infer("sleep", delay_input(400), request_id="slow")
    client.async_stream_infer("sleep", delay_input(1), request_id="fast")
    got = collect.take(2)
    client.stop_stream()
    ids = [result.get_response().id for result, error in got]
    assert ids == ["fast", "slow"]
    for result, error in got:
        assert error is None
        response = result.get_response()
        assert response.parameters["triton_final_response"].bool_param is True
        assert response.model_name == "sleep" and response.model_version == "1"


def test_500_requests_with_interleaved_errors(client: Client) -> None:
    collect = Collector()
    client.start_stream(callback=collect)
    expected_ok: dict[str, int] = {}
    errors = 0
    for i in range(500):
        if i % 5 == 1:
            client.async_stream_infer("nope", add_sub_inputs(i), request_id=f"e{i}")  # unknown model
            errors += 1
        elif i % 5 == 3:
            client.async_stream_infer(
                "simple", add_sub_inputs(i, batch=9), request_id=f"e{i}"
            )  # batch too big
            errors += 1
        else:
            client.async_stream_infer("simple", add_sub_inputs(i), request_id=f"ok{i}")
            expected_ok[f"ok{i}"] = i
    got = collect.take(500)
    oks = [r for r, e in got if e is None]
    failures = [e for r, e in got if e is not None]
    assert len(failures) == errors and len(oks) == 500 - errors
    assert all("unknown model" in e.message() or "batch" in e.message() for e in failures)
    for result in oks:
        rid = result.get_response().id
        assert np.array_equal(
            result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * expected_ok.pop(rid), np.int32)
        )
    assert not expected_ok
    # the stream is still open and working after the errors
    client.async_stream_infer("simple", add_sub_inputs(7), request_id="after")
    result, error = collect.take(1)[0]
    assert error is None and result.get_response().id == "after"
    client.stop_stream()


def test_half_close_waits_for_every_answer(client: Client, inproc: Inproc) -> None:
    collect = Collector()
    client.start_stream(callback=collect)
    for i in range(10):
        client.async_stream_infer("sleep", delay_input(50 + 10 * i), request_id=str(i))
    client.stop_stream(cancel_requests=False)  # half-close, then wait for the stream to end
    assert collect.items.qsize() == 10
    assert wait_until(lambda: inproc[0].frontend.stream.open_streams == 0)


def test_cancel_cleans_up(client: Client, inproc: Inproc) -> None:
    server, repo = inproc
    scheduler = repo.models["sleep"].scheduler
    scheduler.gate = threading.Event()  # the requests wait here: none can be answered before it opens
    baseline = server.pending_tasks()
    collect = Collector()
    client.start_stream(callback=collect)
    for i in range(8):
        client.async_stream_infer("sleep", delay_input(1), request_id=str(i))
    assert wait_until(lambda: len(scheduler.jobs) == 8, 60)
    client.stop_stream(cancel_requests=True)
    assert scheduler.queued == 8  # returned while every request is held: it did not wait for them
    assert all(result is None for result, _ in collect.take(collect.items.qsize()))  # the cancel, no answer
    assert wait_until(lambda: server.frontend.stream.open_streams == 0, 60)
    scheduler.gate.set()  # the cancelled requests finish in the scheduler; their answers go nowhere
    assert wait_until(lambda: scheduler.queued == 0 and server.pending_tasks() <= baseline, 60)
    # and the server serves new streams
    client.start_stream(callback=collect)
    client.async_stream_infer("sleep", delay_input(1), request_id="new")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        result, _error = collect.items.get(timeout=10)
        if result is not None and result.get_response().id == "new":
            break
    client.stop_stream()


def test_triton_grpc_error_mode_ends_the_stream(client: Client) -> None:
    collect = Collector()
    client.start_stream(callback=collect, headers={"triton_grpc_error": "true"})
    client.async_stream_infer("simple", add_sub_inputs(1), request_id="good")
    result, error = collect.take(1)[0]
    assert error is None
    client.async_stream_infer("nope", add_sub_inputs(1), request_id="bad")
    result, error = collect.take(1)[0]
    assert result is None and error.status() == "StatusCode.NOT_FOUND"
    client.stop_stream(cancel_requests=True)


def test_backpressure_bounds_requests_in_flight(client: Client, inproc: Inproc) -> None:
    server, repo = inproc
    server.frontend.stream.max_inflight = 4
    active = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def tracked(inputs: dict[str, Any]) -> dict[str, Any]:
        with lock:
            active["now"] += 1
            active["peak"] = max(active["peak"], active["now"])
        time.sleep(0.02)
        with lock:
            active["now"] -= 1
        return {"OUT": np.array(inputs["DELAY_MS"], dtype=np.int32)}

    repo.models["sleep"].scheduler.fn = tracked
    collect = Collector()
    client.start_stream(callback=collect)
    for i in range(40):
        client.async_stream_infer("sleep", delay_input(i), request_id=str(i))
    got = collect.take(40)
    client.stop_stream()
    assert all(error is None for _, error in got)
    assert active["peak"] <= 4


def test_malformed_message_on_a_stream_gets_an_error_message(inproc: Inproc) -> None:
    good = service_pb2.ModelInferRequest(model_name="sleep", id="g")
    good.inputs.add(name="DELAY_MS", datatype="INT32", shape=[1, 1])
    good.raw_input_contents.append(np.array([1], np.int32).tobytes())
    with grpc.insecure_channel(inproc[0].url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = [
            service_pb2.ModelStreamInferResponse.FromString(raw)
            for raw in call(iter([b"\x0a\xff\x01", good.SerializeToString()]), timeout=30)
        ]
    assert len(answers) == 2
    by_error = sorted(answers, key=lambda a: a.error_message)
    assert by_error[0].error_message == "" and by_error[0].infer_response.id == "g"
    assert by_error[1].error_message.startswith("Unable to parse request")


@pytest.mark.parametrize("streams", [4])
def test_many_streams_at_once(inproc: Inproc, streams: int) -> None:
    clients = [grpcclient.InferenceServerClient(inproc[0].url) for _ in range(streams)]
    collectors = [Collector() for _ in clients]
    try:
        for c, collect in zip(clients, collectors, strict=True):
            c.start_stream(callback=collect)
        for i in range(25):
            for k, c in enumerate(clients):
                c.async_stream_infer("simple", add_sub_inputs(k), request_id=f"{k}-{i}")
        for k, collect in enumerate(collectors):
            for result, error in collect.take(25):
                assert error is None and result.get_response().id.startswith(f"{k}-")
    finally:
        for c in clients:
            c.stop_stream()
            c.close()
