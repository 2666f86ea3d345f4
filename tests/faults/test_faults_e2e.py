"""Issue 13, faults against a real `edgeserve serve` process: a model file that vanishes or is
corrupted before a reload (the load fails clearly, the old version keeps serving), the disk full under
the compiled-model / accuracy cache (loads still succeed), and clients that leave mid-request over
HTTP, gRPC and ZeroMQ (nothing leaks: pending counts and ZeroMQ client/in-flight gauges go back to 0,
the next requests are answered)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from es_server import ROOT, RunningServer, ServerFactory
from onnx_models import MLP_CONFIG, ORT, write_model
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edgeserve.scheduling.queue import QUEUE_FULL_MESSAGE

pytestmark = pytest.mark.timeout(240)

# a conv over a big image: slow enough (tens of ms) that requests overlap and queue up
CONV_CONFIG = ORT + "max_batch_size: 1\n"
IMAGE = (1, 3, 1024, 1024)


def _mlp_body() -> bytes:
    x = np.ones((1, 16), dtype=np.float32)
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": x.ravel().tolist()}]}
    ).encode()


def _infer_mlp(server: RunningServer) -> requests.Response:
    return requests.post(f"{server.base}/v2/models/mlp/infer", data=_mlp_body(), timeout=60)


def _index(server: RunningServer) -> list[dict[str, str]]:
    r = requests.post(f"{server.base}/v2/repository/index", data=b"{}", timeout=30)
    assert r.status_code == 200, r.text
    entries: list[dict[str, str]] = r.json()
    return entries


def _metrics(server: RunningServer) -> str:
    r = requests.get(f"{server.base}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def _gauge_sum(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _wait_quiet(server: RunningServer, zmq: bool = False, timeout: float = 60.0) -> str:
    """Poll /metrics until nothing is pending (and no ZeroMQ client/request is known); the last text."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(server)
        busy = _gauge_sum(text, "nv_inference_pending_request_count")
        if zmq:
            busy += _gauge_sum(text, "edgeserve_zmq_clients") + _gauge_sum(text, "edgeserve_zmq_inflight")
        if busy == 0:
            return text
        assert time.monotonic() < deadline, f"still busy after the clients left:\n{text}"
        time.sleep(0.25)


def _conv_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    write_model(repo, "conv", "conv", config=CONV_CONFIG)
    return repo


def _conv_http_request(binary_output: bool = False) -> tuple[bytes, bytes]:
    """(headers, body) of a binary-tensor HTTP infer request for `conv`; its answer (4 million floats)
    in JSON, the costliest one to encode, unless `binary_output`."""
    data = np.random.default_rng(0).standard_normal(IMAGE).astype(np.float32).tobytes()
    document: dict[str, object] = {
        "inputs": [
            {
                "name": "images",
                "datatype": "FP32",
                "shape": list(IMAGE),
                "parameters": {"binary_data_size": len(data)},
            }
        ]
    }
    if binary_output:
        document["parameters"] = {"binary_data_output": True}
    header = json.dumps(document).encode()
    body = header + data
    head = (
        b"POST /v2/models/conv/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(header), len(body))
    )
    return head, body


def _conv_grpc_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="conv")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "images", "FP32"
    tensor.shape.extend(IMAGE)
    request.raw_input_contents.append(np.ones(IMAGE, dtype=np.float32).tobytes())
    return request


# -- reload faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["vanished", "corrupted"])
def test_reload_with_a_broken_model_file_keeps_the_old_version(
    server_factory: ServerFactory, tmp_path: Path, fault: str
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo)
    before = _infer_mlp(server)
    assert before.status_code == 200, before.text
    model_file = repo / "mlp" / "1" / "model.onnx"
    if fault == "vanished":
        model_file.unlink()
    else:
        model_file.write_bytes(os.urandom(4096))
    r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
    assert 400 <= r.status_code < 600, r.text
    error = r.json()["error"]
    assert "mlp" in error
    if fault == "vanished":
        assert "model.onnx" in error, error
    # the old version keeps serving, with the same answers
    after = _infer_mlp(server)
    assert after.status_code == 200, after.text
    assert after.json()["outputs"] == before.json()["outputs"]
    assert requests.get(f"{server.base}/v2/models/mlp/ready", timeout=30).status_code == 200
    entries = [e for e in _index(server) if e["name"] == "mlp"]
    assert [(e["version"], e["state"]) for e in entries] == [("1", "READY")], entries
    # the failed reload is reported by the load call; the index keeps the serving version READY
    # (tests/repository/test_reload.py pins an empty reason there)
    assert server.alive()


# -- a full disk under the cache ----------------------------------------------------------------
@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "cache"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip() or result.returncode}")
    try:
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        with pytest.raises(OSError):  # really full
            (mount / "probe").write_bytes(b"x" * 8192)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_full_disk_under_the_cache_does_not_fail_loads(
    server_factory: ServerFactory, tmp_path: Path, full_tmpfs: Path
) -> None:
    """Models over the profile's OpenVINO floor, with no backend pinned: the plan picks OpenVINO on an
    x86 CPU, which writes its compiled model to `<cache_dir>/openvino`; on a full disk that write
    fails and the load must not."""
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", hidden=2048)
    server = server_factory(repo, env={"EDGESERVE_RUNTIME_CACHE_DIR": str(full_tmpfs)})
    assert _infer_mlp(server).status_code == 200
    # a model loaded later, while the cache stays full
    write_model(repo, "mlp2", "mlp", hidden=2048, seed=3)
    r = requests.post(f"{server.base}/v2/repository/models/mlp2/load", timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(f"{server.base}/v2/models/mlp2/infer", data=_mlp_body(), timeout=60)
    assert r.status_code == 200, r.text
    # a reload too
    r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
    assert r.status_code == 200, r.text
    assert _infer_mlp(server).status_code == 200
    assert server.alive()
    assert "Traceback" not in server.log()
    assert not list(full_tmpfs.rglob("*.blob"))  # nothing fitted: the write really failed


def test_accuracy_cache_write_on_a_full_disk_is_logged_and_leaves_no_temp_file(
    full_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The accuracy-check cache (hardware/accuracy.py) on the same full disk: the write fails with a
    warning, not an exception, and no half-written temporary file is left behind."""
    from edgeserve.hardware.accuracy import AccuracyGuard

    (full_tmpfs / "accuracy").mkdir()  # a directory costs no data block: the file write is what fails
    guard = AccuracyGuard(full_tmpfs)
    file = guard.cache.file("0" * 64)
    with caplog.at_level("WARNING", logger="edgeserve.hardware"):
        guard.cache.store("0" * 64, {"key": {"ok": True, "error": 0.0, "note": "x" * 65536}})
    assert "cannot cache the accuracy check" in caplog.text
    assert file is not None and not file.exists()
    assert list((full_tmpfs / "accuracy").iterdir()) == []


# -- clients that leave mid-request -------------------------------------------------------------
@pytest.mark.timeout(480)  # twelve 12 MB requests and their conv runs on a box that may be saturated
def test_http_clients_leaving_mid_request_leak_nothing(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = server_factory(_conv_repo(tmp_path))
    head, body = _conv_http_request()
    # half a body, then gone
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(head + body[: len(body) // 2])
    # a whole request, then gone before the answer (several at once, so some wait in the queue)
    socks = [socket.create_connection(("127.0.0.1", server.http_port), timeout=30) for _ in range(8)]
    for sock in socks:
        # A busy server may refuse a request that would find the queue full before reading its body
        # (503, then close): the send meets a reset, which is an allowed answer, not a leak.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(head + body)
    for sock in socks:
        sock.close()
    _wait_quiet(server)
    assert _infer_mlp(server).status_code == 200
    # Answered (binary: its answer's encoding is not what this checks), however busy the box; the
    # deadline is the test's own.
    head, body = _conv_http_request(binary_output=True)
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=180) as sock:
        sock.sendall(head + body)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    assert server.alive()
    assert "Traceback" not in server.log()


def test_grpc_clients_cancelling_mid_request_leak_nothing(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_conv_repo(tmp_path))
    request = _conv_grpc_request()

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(
            server.grpc_url,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        ) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            # unary calls cancelled while in flight
            calls = [stub.ModelInfer(request, timeout=60) for _ in range(8)]
            await asyncio.sleep(0.05)
            for call in calls:
                call.cancel()
            for call in calls:
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await call

            # a stream cancelled with requests in flight, after its first answer
            async def requests_() -> AsyncIterator[service_pb2.ModelInferRequest]:
                for _ in range(8):
                    yield request
                await asyncio.sleep(60)

            stream = stub.ModelStreamInfer(requests_(), timeout=120)
            first = await stream.read()  # an answer, or the scheduler shedding what cannot run in time
            assert first.infer_response.model_name == "conv"
            assert first.error_message in ("", QUEUE_FULL_MESSAGE), first.error_message
            stream.cancel()
            # the channel still works: answered, or shed while the cancelled stream's requests still
            # fill the queue (on a busy box), and answered once they have run
            deadline = time.monotonic() + 60
            while True:
                try:
                    answer = await stub.ModelInfer(request, timeout=60)
                    break
                except grpc.aio.AioRpcError as exc:
                    shed = exc.code() == grpc.StatusCode.UNAVAILABLE and exc.details() == QUEUE_FULL_MESSAGE
                    if not shed or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            assert answer.model_name == "conv"

    asyncio.run(scenario())
    _wait_quiet(server)
    assert _infer_mlp(server).status_code == 200
    assert server.alive()
    assert "Traceback" not in server.log()


ZMQ_CLIENT = """
import os, signal, sys
import numpy as np
from edgeserve.client import ZmqClient
client = ZmqClient(sys.argv[1], timeout=30)
image = np.ones((1, 3, 1024, 1024), dtype=np.float32)
futures = [client.submit("conv", {"images": image}) for _ in range(int(sys.argv[2]))]
futures[0].result()  # the server has them
if sys.argv[3] == "close":
    client.close()  # a polite close with requests in flight
    print("closed", flush=True)
else:
    print("killing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # gone, without a word
"""


@pytest.mark.parametrize("how", ["close", "kill"])
def test_zmq_client_gone_with_requests_in_flight_leaks_nothing(
    server_factory: ServerFactory, tmp_path: Path, how: str
) -> None:
    server = server_factory(_conv_repo(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", ZMQ_CLIENT, server.zmq_endpoint, "16", how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == -9, proc.stderr
    text = _wait_quiet(server, zmq=True)
    assert _gauge_sum(text, "edgeserve_zmq_requests_total") >= 1
    from edgeserve.client import ZmqClient

    with ZmqClient(server.zmq_endpoint, timeout=60) as client:
        out = client.infer("conv", {"images": np.ones(IMAGE, dtype=np.float32)}).as_numpy("features")
        assert out.shape == (1, 4, 1024, 1024)
    _wait_quiet(server, zmq=True)
    assert server.alive()
    assert "Traceback" not in server.log()
