"""Response cache end to end against a real `edgeserve serve`: many HTTP and gRPC clients sending
distinct inputs and repeats each get exactly the model's own answer, hits and misses are counted in
the stats and /metrics, a model without `response_cache` never caches, LRU eviction under
`[server] cache_mb`, and a reload drops the model's entries."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server, wait_until
from onnx_models import write_model

from edgeserve.client import ZmqClient

pytestmark = pytest.mark.timeout(300)

MLP = """backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
"""
CACHED = MLP + "response_cache { enable: true }\n"
BIG = 65536  # float32 elements: 256 KiB per entry, 4 fit in the 1 MiB cache
IDENTITY = f"""backend: "onnxruntime"
max_batch_size: 1
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ {BIG} ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {BIG} ] }} ]
response_cache {{ enable: true }}
"""
THREADS = 8  # per frontend
OWN = 5  # distinct inputs per thread
ROUNDS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("cache")
    repo = tmp / "models"
    write_model(repo, "mlp_cached", "mlp", config=CACHED)
    write_model(repo, "mlp_plain", "mlp", config=MLP)
    write_model(repo, "mlp_gone", "mlp", config=CACHED)
    write_model(repo, "big", "identity", config=IDENTITY, shape=["N", BIG])
    env = {"EDGESERVE_RUNTIME_RACE_BUDGET_S": "0", "EDGESERVE_SERVER_CACHE_MB": "1"}
    running = start_server(repo, tmp, env=env)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(server: RunningServer) -> ort.InferenceSession:
    path = server.repository / "mlp_cached" / "1" / "model.onnx"
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 16)).astype(np.float32)


def _get(server: RunningServer, path: str) -> Any:
    with urllib.request.urlopen(server.base + path, timeout=10) as response:
        body = response.read()
    return json.loads(body) if path.endswith("stats") else body.decode()


def _inference_stats(server: RunningServer, model: str) -> dict[str, Any]:
    stats: dict[str, Any] = _get(server, f"/v2/models/{model}/stats")["model_stats"][0]
    return stats


def _infer(client: Any, module: Any, model: str, data: np.ndarray) -> np.ndarray:
    tensor = module.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    out: np.ndarray = client.infer(model, [tensor]).as_numpy("OUTPUT0")
    return out


def test_concurrent_clients_get_their_own_answers(
    server: RunningServer, reference: ort.InferenceSession
) -> None:
    before_all = _inference_stats(server, "mlp_cached")
    before = before_all["inference_stats"]
    errors: list[str] = []
    shared = _row(999_999)

    def client_thread(index: int, module: Any, url: str) -> None:
        client = module.InferenceServerClient(url)
        try:
            for _ in range(ROUNDS):
                for k in range(OWN):
                    for data in (_row(index * 100 + k), shared):
                        got = _infer(client, module, "mlp_cached", data)
                        expected = reference.run(["OUTPUT0"], {"INPUT0": data})[0]
                        if not np.array_equal(got, expected):
                            errors.append(f"client {index}: {got} != {expected}")
        except Exception as exc:
            errors.append(f"client {index}: {exc!r}")
        finally:
            client.close()

    threads = [
        threading.Thread(target=client_thread, args=(i, httpclient, server.http_url)) for i in range(THREADS)
    ]
    threads += [
        threading.Thread(target=client_thread, args=(THREADS + i, grpcclient, server.grpc_url))
        for i in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    total = 2 * THREADS * ROUNDS * OWN * 2

    def settled() -> bool:  # a worker records a request's statistics just after its answer is sent
        success = _inference_stats(server, "mlp_cached")["inference_stats"]["success"]["count"]
        return bool(success - before["success"]["count"] >= total)

    assert wait_until(settled, 60)
    after = _inference_stats(server, "mlp_cached")
    hits = after["inference_stats"]["cache_hit"]["count"] - before["cache_hit"]["count"]
    misses = after["inference_stats"]["cache_miss"]["count"] - before["cache_miss"]["count"]
    assert hits + misses == total
    own_hits = 2 * THREADS * OWN * (ROUNDS - 1)  # each thread's own inputs: a miss, then hits
    assert hits >= own_hits + (
        2 * THREADS * OWN * ROUNDS - 2 * THREADS
    )  # the shared input: at most 16 misses
    assert after["inference_stats"]["success"]["count"] - before["success"]["count"] == total
    assert after["inference_count"] - before_all["inference_count"] == misses  # hits run nothing


def test_disabled_by_default(server: RunningServer) -> None:
    with httpclient.InferenceServerClient(server.http_url) as client:
        for _ in range(3):
            _infer(client, httpclient, "mlp_plain", _row(7))
    stats = _inference_stats(server, "mlp_plain")
    assert stats["inference_stats"]["cache_hit"]["count"] == 0
    assert stats["inference_stats"]["cache_miss"]["count"] == 0
    assert stats["inference_count"] == 3


def test_hits_skip_the_model_and_show_in_metrics(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        data = _row(4242)
        first = _infer(client, grpcclient, "mlp_cached", data)
        before = _inference_stats(server, "mlp_cached")
        for _ in range(5):
            np.testing.assert_array_equal(_infer(client, grpcclient, "mlp_cached", data), first)
        after = _inference_stats(server, "mlp_cached")
        top = grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)  # classification of a cached answer
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(data)
        labels = client.infer("mlp_cached", [tensor], outputs=[top]).as_numpy("OUTPUT0")
    assert after["inference_count"] == before["inference_count"]  # no model run for a hit
    assert (
        after["inference_stats"]["cache_hit"]["count"] == before["inference_stats"]["cache_hit"]["count"] + 5
    )
    assert [int(x.split(b":")[1]) for x in labels[0]] == np.argsort(-first[0])[:2].tolist()
    metrics = _get(server, "/metrics")
    hits = re.search(r'^nv_cache_num_hits_per_model\{model="mlp_cached",version="1"\} (\d+)', metrics, re.M)
    assert hits is not None and int(hits.group(1)) >= 5
    assert re.search(r"^nv_cache_num_entries \d+", metrics, re.M)
    assert 'nv_cache_num_hits_per_model{model="mlp_plain",version="1"} 0' in metrics


def test_lru_eviction_under_cache_mb(server: RunningServer) -> None:
    def evictions() -> float:
        found = re.search(r"^nv_cache_num_evictions (\S+)", _get(server, "/metrics"), re.M)
        assert found is not None
        return float(found.group(1))

    start = evictions()
    rows = [np.full((1, BIG), float(i), np.float32) for i in range(6)]
    with httpclient.InferenceServerClient(server.http_url) as client:
        for data in rows:
            np.testing.assert_array_equal(_infer(client, httpclient, "big", data), data)
        assert evictions() - start >= 2
        before = _inference_stats(server, "big")["inference_stats"]
        np.testing.assert_array_equal(_infer(client, httpclient, "big", rows[-1]), rows[-1])  # recent: a hit
        np.testing.assert_array_equal(_infer(client, httpclient, "big", rows[0]), rows[0])  # evicted: a miss
        after = _inference_stats(server, "big")["inference_stats"]
    assert after["cache_hit"]["count"] == before["cache_hit"]["count"] + 1
    assert after["cache_miss"]["count"] == before["cache_miss"]["count"] + 1
    metrics = _get(server, "/metrics")
    held = re.search(r"^edgeserve_cache_bytes (\S+)", metrics, re.M)
    assert held is not None and float(held.group(1)) <= 1024 * 1024


def test_reload_drops_the_entries(server: RunningServer) -> None:
    data = _row(31337)
    with httpclient.InferenceServerClient(server.http_url) as client:
        _infer(client, httpclient, "mlp_cached", data)
        _infer(client, httpclient, "mlp_cached", data)
        client.load_model("mlp_cached")  # a reload: a new load of the same version
        _infer(client, httpclient, "mlp_cached", data)
    stats = _inference_stats(server, "mlp_cached")["inference_stats"]
    assert stats["cache_hit"]["count"] == 0 and stats["cache_miss"]["count"] == 1


def test_zmq_hits(server: RunningServer, reference: ort.InferenceSession) -> None:
    data = _row(2024)
    expected = reference.run(["OUTPUT0"], {"INPUT0": data})[0]
    before = _inference_stats(server, "mlp_cached")["inference_stats"]["cache_hit"]["count"]
    with ZmqClient(server.zmq_endpoint, timeout=10) as client:
        for _ in range(4):
            np.testing.assert_array_equal(
                client.infer("mlp_cached", {"INPUT0": data}).as_numpy("OUTPUT0"), expected
            )
    assert _inference_stats(server, "mlp_cached")["inference_stats"]["cache_hit"]["count"] == before + 3


def test_unload_frees_the_entries(server: RunningServer) -> None:
    def entries() -> int:
        found = re.search(r"^nv_cache_num_entries (\S+)", _get(server, "/metrics"), re.M)
        assert found is not None
        return int(float(found.group(1)))

    with httpclient.InferenceServerClient(server.http_url) as client:
        start = entries()
        for seed in range(3):
            _infer(client, httpclient, "mlp_gone", _row(seed))
        assert entries() == start + 3
        client.unload_model("mlp_gone")
    deadline = time.monotonic() + 10
    while entries() != start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entries() == start
