"""Inline runs on the event loop (`[http]` / `[grpc] inline_max_us`): a small model is run by the HTTP
and gRPC frontends themselves, with no hand-off to a worker, and answers and counts exactly as when
every request goes to the worker (`inline_max_us = 0`). A real server on loopback, tritonclient's
HTTP, gRPC unary and gRPC streaming clients, a real ONNX Runtime model that batches.

Whether a request runs inline is decided from its inputs, none of which may hang on this box's speed
here: the model's measured compute time must be under `inline_max_us`, so the limit is one no run
can reach (a busy box's runs take far longer than the 100 µs default); an instance must be idle, so
the model has two (a worker marks its instance free only after its answer is out, so with one the
next request could find it still "running" on a slow box). The compute-time and window decisions
themselves are tests/scheduling/test_scheduler_inline.py's, with a scripted compute time."""

from __future__ import annotations

import queue
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server, wait_until
from onnx_models import write_model

# A batching model (no window: a window caps the inline limit at itself, <= 1 ms) with two instances.
CONFIG = (
    'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching { }\n'
    "instance_group [{ kind: KIND_CPU, count: 2 }]\n"
)
PER_TRANSPORT = 40
ANY_RUN_US = "600000000"  # 10 minutes: longer than any run of a 16-float identity, however busy the box
# The stats of a request run by a worker are recorded just after its answer is sent: wait for them.
STATS_S = 60.0


def metric(server: RunningServer, name: str, model: str) -> float:
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = f'{name}{{model="{model}",version="1"}} '
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    assert len(values) == 1, f"{name} for {model} not exported once"
    return values[0]


def frame(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32)


def drive_every_frontend(server: RunningServer) -> None:
    """PER_TRANSPORT requests each over HTTP, gRPC unary and one gRPC stream, one at a time; every
    answer checked against its input."""
    http = httpclient.InferenceServerClient(server.base.removeprefix("http://"))
    for i in range(PER_TRANSPORT):
        x = frame(i)
        tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_array_equal(http.infer("ident", [tensor]).as_numpy("OUTPUT0"), x)
    http.close()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for i in range(PER_TRANSPORT):
        x = frame(100 + i)
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("ident", [tensor]).as_numpy("OUTPUT0"), x)
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(PER_TRANSPORT):
            x = frame(200 + i)
            tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(x)
            client.async_stream_infer("ident", [tensor], request_id=str(i))
            result, error = answers.get(timeout=30)
            assert error is None, error
            assert isinstance(result, grpcclient.InferResult)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("inline_max_us", [ANY_RUN_US, "0"])
def test_http_and_grpc_run_a_small_model_inline_with_the_same_answers_and_counts(
    tmp_path: Path, inline_max_us: str
) -> None:
    repo = tmp_path / "models"
    write_model(repo, "ident", "identity", datatype="FP32", config=CONFIG)
    env = {"EDGESERVE_HTTP_INLINE_MAX_US": inline_max_us, "EDGESERVE_GRPC_INLINE_MAX_US": inline_max_us}
    running = start_server(repo, tmp_path, env=env)
    try:
        drive_every_frontend(running)
        total = 3 * PER_TRANSPORT
        assert wait_until(lambda: metric(running, "nv_inference_request_success", "ident") >= total, STATS_S)
        assert metric(running, "nv_inference_request_success", "ident") == total
        assert metric(running, "nv_inference_count", "ident") == total
        inline = metric(running, "edgeserve_inline_runs_total", "ident")
        if inline_max_us == "0":
            assert inline == 0
        else:
            # The first request goes to the worker (no compute time known yet); every later one, one
            # client at a time, finds the queue empty and an instance idle: all of them run inline.
            assert inline == total - 1
        assert running.alive()
    finally:
        running.stop()
