"""Sequence batching end to end against a real `edgeserve serve` with the accumulate sample (a running
sum kept as implicit state): 16 interleaved clients over gRPC and HTTP (tritonclient's sequence_id /
sequence_start / sequence_end) each get their own sums; END and the idle timeout free a slot; the
Oldest strategy batches several sequences; Triton's errors; the ZeroMQ header parameters."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import ROOT, RunningServer, start_server
from sequence_steps import run_clients, send_step
from tritonclient.utils import InferenceServerException

from edgeserve.client import ClientError, ZmqClient
from edgeserve.samples import build_accumulate

pytestmark = pytest.mark.timeout(300)

CLIENTS = 16
STEPS = 12
SAMPLE = (ROOT / "models" / "accumulate" / "config.pbtxt").read_text()
IDLE = SAMPLE.replace('name: "accumulate"', 'name: "acc_idle"').replace(
    "max_batch_size: 8", "max_batch_size: 1"
)
IDLE = IDLE.replace("max_sequence_idle_microseconds: 10000000", "max_sequence_idle_microseconds: 400000")
OLDEST = SAMPLE.replace('name: "accumulate"', 'name: "acc_oldest"').replace(
    "max_batch_size: 8", "max_batch_size: 4"
)
OLDEST = OLDEST.replace(
    "direct { }",
    "oldest { max_candidate_sequences: 8 preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 500000 }",
)
DIRECT = SAMPLE.replace("count: 1", "count: 2")  # 2 instances x 8 slots: 16 sequences at once


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("seq")
    repo = tmp / "models"
    for name, config in (("accumulate", DIRECT), ("acc_idle", IDLE), ("acc_oldest", OLDEST)):
        build_accumulate(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(config)
    running = start_server(repo, tmp, env={"EDGESERVE_RUNTIME_RACE_BUDGET_S": "0"})
    yield running
    running.stop()


def _step(
    client: Any, model: str, seq: int | str, value: float, start: bool = False, end: bool = False
) -> float:
    """The running sum after this step (gRPC or HTTP client)."""
    return float(send_step(client, model, seq, value, start, end).as_numpy("OUTPUT")[0, 0])


def _interleaved(step: Callable[[int, int, float, bool, bool], float]) -> list[str]:
    """CLIENTS threads, each its own sequence of STEPS values, released step by step together."""
    barrier = threading.Barrier(CLIENTS)
    errors: list[str] = []

    def run(index: int) -> None:
        running = 0.0
        for n in range(STEPS):
            value = float(index * 1000 + n * 7 + 1)
            running += value
            barrier.wait(60)
            try:
                got = step(index, n, value, n == 0, n == STEPS - 1)
            except Exception as exc:
                errors.append(f"client {index} step {n}: {exc}")
                barrier.abort()
                return
            if got != running:
                errors.append(f"client {index} step {n}: got {got}, expected {running}")

    run_clients(run, CLIENTS)
    return errors


def _stats(server: RunningServer, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as response:
        stats: dict[str, Any] = json.load(response)["model_stats"][0]
    return stats


def test_grpc_interleaved_sequences_keep_their_state(server: RunningServer) -> None:
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(CLIENTS)]
    try:
        errors = _interleaved(lambda i, n, v, s, e: _step(clients[i], "accumulate", 5000 + i, v, s, e))
    finally:
        for client in clients:
            client.close()
    assert errors == []


def test_http_interleaved_string_sequences_keep_their_state(server: RunningServer) -> None:
    clients = [httpclient.InferenceServerClient(server.http_url) for _ in range(CLIENTS)]
    try:
        errors = _interleaved(lambda i, n, v, s, e: _step(clients[i], "accumulate", f"cam-{i}", v, s, e))
    finally:
        for client in clients:
            client.close()
    assert errors == []
    stats = _stats(server, "accumulate")
    assert stats["inference_stats"]["success"]["count"] >= CLIENTS * STEPS


def test_triton_errors(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as err:
            _step(client, "accumulate", 424242, 1.0)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert err.value.message() == (
            "inference request for sequence 424242 to model 'accumulate' must specify the START flag on the "
            "first request of the sequence"
        )
        with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
            _step(client, "accumulate", 0, 1.0)  # no sequence parameters at all
    with httpclient.InferenceServerClient(server.http_url) as http:
        with pytest.raises(InferenceServerException) as err:
            _step(http, "accumulate", "nope", 1.0)
        assert err.value.status() == "400" and "must specify the START flag" in str(err.value.message())


def test_end_and_idle_timeout_free_the_slot(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert _step(client, "acc_idle", 1, 2.0, start=True) == 2.0  # the only slot
        assert _step(client, "acc_idle", 1, 3.0, end=True) == 5.0  # END frees it at once
        assert _step(client, "acc_idle", 2, 4.0, start=True) == 4.0
        with pytest.raises(InferenceServerException) as ended:
            _step(client, "acc_idle", 1, 1.0)
        # sequence 1's slot went with its END, not with the idle timeout (that error would say so)
        assert "START flag" in str(ended.value.message()) and "idle longer" not in str(ended.value.message())
        answers: list[float] = []
        waiter = threading.Thread(
            target=lambda: answers.append(_step(client, "acc_idle", 3, 9.0, start=True))
        )
        waiter.start()  # sequence 3 waits in the backlog until sequence 2 idles out (0.4 s)
        waiter.join(10)
        assert answers == [9.0]
        with pytest.raises(InferenceServerException) as err:
            _step(client, "acc_idle", 2, 1.0)
        # sequence 2's slot went with the idle timeout: that is what let sequence 3 in
        assert "START flag" in str(err.value.message()) and "idle longer" in str(err.value.message())
        assert _step(client, "acc_idle", 3, 1.0, end=True) == 10.0


def test_oldest_strategy_batches_several_sequences(server: RunningServer) -> None:
    totals: dict[int, float] = {}

    def run(seq: int) -> None:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            totals[seq] = _step(client, "acc_oldest", seq, float(seq), start=True)
            totals[seq] = _step(client, "acc_oldest", seq, 1.0, end=True)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert totals == {s: s + 1.0 for s in range(1, 5)}
    stats = _stats(server, "acc_oldest")
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert max(sizes) > 1, sizes  # several sequences ran in one batch
    assert sum(size * count for size, count in sizes.items()) == 8


def test_zmq_sequence_parameters(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=10) as client:

        def step(seq: int | str, value: float, **flags: bool) -> float:
            params = {"sequence_id": seq, **{f"sequence_{k}": v for k, v in flags.items()}}
            result = client.infer(
                "accumulate", {"INPUT": np.full((1, 1), value, np.float32)}, parameters=params
            )
            return float(result.as_numpy("OUTPUT")[0, 0])

        assert step("zmq-a", 1.0, start=True) == 1.0
        assert step(77, 10.0, start=True) == 10.0
        assert step("zmq-a", 2.0) == 3.0
        assert step(77, 5.0, end=True) == 15.0
        assert step("zmq-a", 3.0, end=True) == 6.0
        with pytest.raises(ClientError, match="START flag"):
            step(77, 1.0)


def test_grpc_stream_sequence_in_order(server: RunningServer) -> None:
    results: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        results.append(error if error is not None else float(result.as_numpy("OUTPUT")[0, 0]))
        if len(results) == 4:
            done.set()

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback)
        for n, value in enumerate((1.0, 2.0, 3.0, 4.0)):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.full((1, 1), value, np.float32))
            client.async_stream_infer("accumulate", [tensor], sequence_id=8080, sequence_start=n == 0,
                                      sequence_end=n == 3)  # fmt: skip
        assert done.wait(20)
        client.stop_stream()
    assert results == [1.0, 3.0, 6.0, 10.0]


def test_metrics_show_sequences(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _step(client, "accumulate", 31, 1.0, start=True)
        with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as response:
            text = response.read().decode()
        _step(client, "accumulate", 31, 1.0, end=True)
    assert 'edgeserve_sequence_active{model="accumulate",version="1"}' in text
    assert 'edgeserve_sequence_backlog{model="accumulate",version="1"} 0.0' in text
