"""The ZeroMQ path against a real `edgeserve run` (ONNX Runtime models, real sockets, real shm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import ROOT, RunningServer, scrape, start_server, wait_until
from onnx_models import ONNX_TYPES, ORT, write_model
from tritonclient.utils import InferenceServerException
from zmq_harness import assert_same, sample

from edgeserve.client import ClientError, ShmTensor, ZmqClient

PRODUCER = Path(__file__).with_name("zmq_producer.py")
E2E_TYPES = list(
    ONNX_TYPES
)  # BF16 is not served by the ONNX Runtime backend; its wire path is in test_zmq_frontend
QUEUED_CONV = (
    ORT
    + """max_batch_size: 1
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("zmq")
    repo = tmp / "models"
    for datatype in E2E_TYPES:
        write_model(repo, f"id_{datatype.lower()}", "identity", datatype=datatype, config=ORT)
    write_model(repo, "conv_q1", "conv", config=QUEUED_CONV)
    running = start_server(repo, tmp)
    yield running
    running.stop()


def regions(client: ZmqClient) -> set[str]:
    return {r["name"] for r in client.regions()}


def test_round_trip_every_datatype(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=10) as client:
        ring = client.create_ring(slots=4, slot_size=4096)
        for datatype in E2E_TYPES:
            data = sample(datatype, (3, 7), seed=len(datatype))
            model = f"id_{datatype.lower()}"
            assert_same(client.infer(model, {"INPUT0": data}).as_numpy("OUTPUT0"), data)
            result = client.infer(model, {"INPUT0": data}, {"OUTPUT0": ring}, ring=ring)
            assert_same(result.as_numpy("OUTPUT0"), data)
        assert ring.free == 4


def run_producer(server: RunningServer, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(PRODUCER), server.zmq_endpoint, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_four_producers_x_200_frames_results_match_frames(server: RunningServer) -> None:
    producers = [
        run_producer(server, "id_int32", str(p), "200", *(["out_ring"] if p % 2 else [])) for p in range(4)
    ]
    reports = []
    for proc in producers:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        assert report == {"producer": report["producer"], "ok": 200, "mismatched": 0, "errors": []}
    leftovers = [name for name in server.shm_regions() if name.startswith("edgeserve-ring-")]
    assert leftovers == []  # every producer's rings went with its bye


def test_producer_killed_mid_stream(server: RunningServer) -> None:
    victim = run_producer(server, "id_int32", "9", "0", "forever")
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline().split()
        assert line[:1] == ["STREAMING"], victim.stderr.read() if victim.stderr else ""
        ring_name = line[1]
        with ZmqClient(server.zmq_endpoint, timeout=10) as other:
            mine = other.create_ring(slots=4, slot_size=4096)
            assert ring_name in server.shm_regions() and ring_name not in regions(other)  # not other's
            victim.kill()
            victim.wait(10)
            deadline = time.monotonic() + 10
            while ring_name in server.shm_regions() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ring_name not in server.shm_regions(), "the killed producer's ring is still registered"
            assert mine.name in regions(other)
            for i in range(20):  # the server keeps serving the others
                data = np.full((1, 8), i, np.int32)
                assert_same(other.infer("id_int32", {"INPUT0": data}, ring=mine).as_numpy("OUTPUT0"), data)
        with urllib.request.urlopen(server.base + "/v2/systemsharedmemory/status", timeout=5) as response:
            assert ring_name not in {r["name"] for r in json.loads(response.read())}
        assert server.alive()
        assert "released its shm regions" in server.log()
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)


def test_full_queue_is_reported_at_once(server: RunningServer) -> None:
    image = np.random.default_rng(0).standard_normal((1, 3, 384, 384)).astype(np.float32)
    with ZmqClient(server.zmq_endpoint, timeout=30) as client:
        futures = [client.submit("conv_q1", {"images": image}) for _ in range(24)]
        finished = [future.exception() for future in client.as_completed(futures, timeout=60)]
    rejected = [(n, e) for n, e in enumerate(finished) if e is not None]  # n: completion order
    served = [n for n, e in enumerate(finished) if e is None]
    assert rejected and served
    for _, error in rejected:
        assert isinstance(error, ClientError) and error.status == "UNAVAILABLE"
        assert "Exceeds maximum queue size" in error.message
    assert min(n for n, _ in rejected) < max(served)  # told before the queue drained


def test_one_region_registry_for_every_frontend(server: RunningServer) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import shared_memory as triton_shm

    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    key = f"/es_xfe_{uuid.uuid4().hex[:8]}"
    handle = triton_shm.create_shared_memory_region("xfe_grpc", key, 1024)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        triton_shm.set_shared_memory_region(handle, [data])
        grpc.register_system_shared_memory("xfe_grpc", key, 1024)
        with ZmqClient(server.zmq_endpoint, timeout=10) as client:
            # a region registered over gRPC is usable over ZeroMQ by the same user (not its to remove)
            listed = {r["name"]: r for r in client.regions()}
            assert listed["xfe_grpc"]["mine"] is False
            result = client.infer(
                "id_fp32",
                {"INPUT0": ShmTensor("xfe_grpc", 64, 0, "FP32", (1, 16))},
                {"OUTPUT0": ShmTensor("xfe_grpc", 64, 512)},
            )
            assert result.shm_outputs["OUTPUT0"]["shape"] == [1, 16]
            assert_same(triton_shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=512), data)
            with pytest.raises(ClientError) as info:
                client.unregister_region("xfe_grpc")
            assert info.value.status == "PERMISSION_DENIED"

            # a ring registered over ZeroMQ belongs to its socket: not even the same process may name it
            # over gRPC or HTTP (shm/binding.py)
            ring = client.create_ring(slots=2, slot_size=256)
            slot = ring.acquire()
            slot.write(data)
            start = ring.layout.slot_offset(slot.index)
            assert ring.name in {r["name"] for r in client.regions()}
            # the Triton-protocol status lists only Triton-protocol regions (its "unregister all" too)
            assert ring.name not in {r["name"] for r in http.get_system_shared_memory_status()}
            for module, triton in ((grpcclient, grpc), (httpclient, http)):
                inp = module.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_shared_memory(ring.name, 64, offset=start)
                with pytest.raises(InferenceServerException) as refused:
                    triton.infer("id_fp32", [inp])
                assert f"Unable to find shared memory region: '{ring.name}'" in str(refused.value.message())
            slot.release()
        assert ring.name not in server.shm_regions()  # the ring went with the client's bye
    finally:
        grpc.unregister_system_shared_memory("xfe_grpc")
        triton_shm.destroy_shared_memory_region(handle)
        grpc.close()
        http.close()


def model_stats(server: RunningServer, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as response:
        stats: dict[str, Any] = json.loads(response.read())["model_stats"][0]
    return stats


# Inline or not is decided from inputs that must not hang on this box's speed: a limit no run reaches
# (10 minutes; a busy box's runs pass the 2 ms default), and two instances, so that one is idle even
# while a worker that just answered (an HTTP request's) has not yet marked its own free.
ANY_RUN_US = "600000000"
TWO_INSTANCES = "max_batch_size: 8\ndynamic_batching { }\ninstance_group [{ kind: KIND_CPU, count: 2 }]\n"


@pytest.mark.parametrize("inline_max_us", [ANY_RUN_US, "0"])
def test_inline_runs_and_worker_hand_offs_answer_and_count_alike(tmp_path: Path, inline_max_us: str) -> None:
    """A fast model runs on the ZeroMQ thread or is handed to its worker (0): the same answers, and
    the statistics count every request once either way, with HTTP traffic alongside."""
    repo = tmp_path / "models"
    write_model(repo, "ident", "identity", datatype="FP32", config=ORT + TWO_INSTANCES)
    running = start_server(repo, tmp_path, env={"EDGESERVE_ZMQ_INLINE_MAX_US": inline_max_us})
    try:
        with ZmqClient(running.zmq_endpoint, timeout=10) as client:
            ring = client.create_ring(slots=2, slot_size=4096)
            for i in range(100):
                data = sample("FP32", (1, 16), seed=i)
                slot = ring.acquire()
                slot.ndarray((1, 16), np.float32)[:] = data
                result = client.infer("ident", {"INPUT0": slot.tensor((1, 16), np.float32)})
                assert_same(result.as_numpy("OUTPUT0"), data)
                if i % 25 == 0:  # the event loop's frontends share the model meanwhile
                    body = json.dumps(
                        {
                            "inputs": [
                                {
                                    "name": "INPUT0",
                                    "datatype": "FP32",
                                    "shape": [1, 16],
                                    "data": data.ravel().tolist(),
                                }
                            ]
                        }
                    ).encode()
                    request = urllib.request.Request(f"{running.base}/v2/models/ident/infer", body)
                    with urllib.request.urlopen(request, timeout=10) as response:
                        out = json.loads(response.read())["outputs"][0]["data"]
                    np.testing.assert_allclose(out, data.ravel())
        # A worker records a request's statistics just after sending its answer: wait for the last.
        assert wait_until(lambda: model_stats(running, "ident")["inference_count"] >= 104, 60)
        stats = model_stats(running, "ident")
        assert stats["inference_count"] == 104
        assert stats["inference_stats"]["success"]["count"] == 104
        assert stats["inference_stats"]["fail"]["count"] == 0
        assert stats["inference_stats"]["compute_infer"]["count"] == stats["execution_count"]
        counters = zmq_metrics(running)
        assert counters["edgeserve_zmq_requests_total"] >= 100  # + the ring's registration
        if inline_max_us == "0":
            assert counters["edgeserve_zmq_inline_runs_total"] == 0
        else:  # all but the first (no compute time known yet), whatever the HTTP requests did
            assert counters["edgeserve_zmq_inline_runs_total"] == 99
        assert running.alive()
    finally:
        running.stop()


def zmq_metrics(server: RunningServer) -> dict[str, float]:
    return scrape(server.base, "edgeserve_zmq_")


@pytest.mark.parametrize("spin_us", ["10000", "0"])
def test_the_frontend_answers_back_to_back_and_spaced_requests_spinning_or_not(
    tmp_path: Path, spin_us: str
) -> None:
    """Every request is answered whether the ZeroMQ thread spins or sleeps between them, and with
    spin_us = 0 it never spins. When it spins is decided by spin.py and tested with an injected
    clock (test_zmq_spin.py); how many requests a real box catches is measured by
    benchmarks/bench_zmq_spin.py, not asserted here."""
    repo = tmp_path / "models"
    write_model(repo, "ident", "identity", datatype="FP32", config=ORT + "max_batch_size: 8\n")
    running = start_server(repo, tmp_path, env={"EDGESERVE_ZMQ_SPIN_US": spin_us})
    try:
        data = sample("FP32", (1, 16))
        with ZmqClient(running.zmq_endpoint, timeout=10, spin_us=0) as client:
            for _ in range(30):
                assert_same(client.infer("ident", {"INPUT0": data}).as_numpy("OUTPUT0"), data)
            for _ in range(5):
                time.sleep(0.03)
                assert_same(client.infer("ident", {"INPUT0": data}).as_numpy("OUTPUT0"), data)
            final = zmq_metrics(running)
        assert final["edgeserve_zmq_requests_total"] >= 35
        assert 0 <= final["edgeserve_zmq_spin_hits_total"] <= final["edgeserve_zmq_requests_total"]
        if spin_us == "0":
            assert final["edgeserve_zmq_spin_hits_total"] == 0
        assert final["edgeserve_zmq_inflight"] == 0 and running.alive()
    finally:
        running.stop()
