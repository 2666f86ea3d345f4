"""End to end over HTTP, management: zero-downtime reload under load, load with file overrides,
unload, bad requests (4xx with a clear message, server stays up) and the admin API via tritonclient."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from es_server import ServerFactory, wait_until
from http_e2e_helpers import (
    assert_good_request_works,
    client,
    json_mlp_request,
    mlp_infer,
    mlp_repo,
    ort_run,
    post_infer,
)
from onnx_models import write_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)


# -- zero-downtime reload ---------------------------------------------------------------------------
ANSWERS = 6  # requests answered before the first reload and after each


def test_reload_under_load_fails_no_request(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = mlp_repo(tmp_path)
    server = server_factory(repo)
    x = np.random.default_rng(4).standard_normal((1, 16)).astype(np.float32)
    body = json.dumps(json_mlp_request(x)).encode()
    stop = threading.Event()
    outcomes: list[tuple[int, str, str]] = []

    def hammer() -> None:
        session = requests.Session()
        deadline = time.monotonic() + 280  # a safety stop only: the test stops it
        while not stop.is_set() and time.monotonic() < deadline:
            r = session.post(f"{server.base}/v2/models/mlp/infer", data=body, timeout=30)
            version = r.json().get("model_version", "") if r.status_code == 200 else ""
            outcomes.append((r.status_code, version, r.text if r.status_code != 200 else ""))

    def answered(more: int) -> None:
        """Wait for `more` answers (events, not a time: a busy box answers slowly, never wrongly)."""
        target = len(outcomes) + more
        assert wait_until(lambda: len(outcomes) >= target, 120), f"{len(outcomes)} answers"

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        answered(ANSWERS)  # by version 1
        write_model(repo, "mlp", "mlp", version=2, seed=9)  # new weights
        r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
        assert r.status_code == 200, r.text
        answered(ANSWERS)
        new_config = {
            "max_batch_size": 4,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
            "dynamic_batching": {"max_queue_delay_microseconds": 1000},
        }
        r = requests.post(
            f"{server.base}/v2/repository/models/mlp/load",
            json={"parameters": {"config": json.dumps(new_config)}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        answered(ANSWERS)
        # A failed reload (corrupt model file) keeps the old version serving.
        (repo / "mlp" / "3").mkdir()
        (repo / "mlp" / "3" / "model.onnx").write_bytes(b"this is not an onnx model")
        r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
        assert r.status_code >= 400 and r.json()["error"], r.text
        answered(ANSWERS)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    failures = [o for o in outcomes if o[0] != 200]
    assert not failures, failures[:5]
    versions = [o[1] for o in outcomes]
    assert len(outcomes) >= 4 * ANSWERS and "1" in versions and "2" in versions and versions[-1] == "2"
    assert requests.get(f"{server.base}/v2/models/mlp/config", timeout=10).json()["max_batch_size"] == 4
    (want,) = ort_run(repo / "mlp/2/model.onnx", {"INPUT0": x})
    np.testing.assert_allclose(mlp_infer(client(server), x), want, rtol=1e-6, atol=1e-7)
    assert server.alive()


def test_load_with_file_overrides_and_unload(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = mlp_repo(tmp_path)
    server = server_factory(repo)
    cli = client(server)
    staging = tmp_path / "staging"
    write_model(staging, "uploaded", "mlp", seed=11)
    onnx_bytes = (staging / "uploaded/1/model.onnx").read_bytes()
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})
    cli.load_model("uploaded", config=config, files={"file:1/model.onnx": onnx_bytes})
    assert cli.is_model_ready("uploaded")
    x = np.ones((2, 16), dtype=np.float32)
    (want,) = ort_run(staging / "uploaded/1/model.onnx", {"INPUT0": x})
    np.testing.assert_allclose(mlp_infer(cli, x, model="uploaded"), want, rtol=1e-6, atol=1e-7)
    # the same over raw HTTP with base64, as curl users do
    r = requests.post(
        f"{server.base}/v2/repository/models/uploaded2/load",
        timeout=120,
        json={"parameters": {"config": config, "file:1/model.onnx": base64.b64encode(onnx_bytes).decode()}},
    )
    assert r.status_code == 200, r.text
    cli.unload_model("uploaded")
    assert not cli.is_model_ready("uploaded")
    with pytest.raises(InferenceServerException):
        mlp_infer(cli, x, model="uploaded")
    assert cli.is_model_ready("mlp") and server.alive()


# -- bad requests ----------------------------------------------------------------------------------
def test_bad_requests_get_4xx_with_a_clear_message(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = mlp_repo(tmp_path)
    server = server_factory(repo, env={"EDGESERVE_HTTP_MAX_INPUT_BYTES": str(1 << 20)})
    good = json_mlp_request(np.ones((1, 16), dtype=np.float32))
    x16 = np.ones((1, 16), dtype=np.float32)
    binary_header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, 16],
                    "parameters": {"binary_data_size": 64},
                }
            ]
        }
    ).encode()

    def variant(**change: Any) -> dict[str, Any]:
        return {"inputs": [{**good["inputs"][0], **change}]}

    cases: list[tuple[str, Any, dict[str, str], int, str]] = [
        ("mlp", variant(datatype="INT32", data=[[1] * 16]), {}, 400, "data-type"),
        ("mlp", variant(shape=[1, 15], data=[[1.0] * 15]), {}, 400, "shape"),
        ("mlp", variant(name="IN"), {}, 400, "'IN'"),
        ("mlp", variant(data=[[1.0] * 15]), {}, 400, "number of elements"),
        ("mlp", variant(data=[["a"] * 16]), {}, 400, "FP32"),
        ("mlp", {**good, "outputs": [{"name": "NOPE"}]}, {}, 400, "NOPE"),
        ("mlp", b'{"inputs": [', {}, 400, "JSON"),
        ("mlp", b"\x00\x01garbage", {}, 400, "JSON"),
        (
            "mlp",
            binary_header + x16.tobytes()[:60],
            {"Inference-Header-Content-Length": str(len(binary_header))},
            400,
            "binary_data_size",
        ),
        (
            "mlp",
            binary_header + x16.tobytes(),
            {"Inference-Header-Content-Length": "12345678"},
            400,
            "Inference-Header-Content-Length",
        ),
        (
            "mlp",
            binary_header + x16.tobytes(),
            {"Inference-Header-Content-Length": "nan"},
            400,
            "Inference-Header-Content-Length",
        ),
        ("mlp", binary_header + x16.tobytes(), {}, 400, "JSON"),
        ("nope", good, {}, 404, "nope"),
        ("mlp/versions/7", good, {}, 404, "7"),
        ("mlp", b"x" * ((1 << 20) + 10), {}, 413, "exceeds"),
    ]
    for model, body, headers, status, needle in cases:
        r = post_infer(server, model, body, headers)
        assert r.status_code == status, (model, r.status_code, r.text)
        message = r.json()["error"]
        assert needle in message, (needle, message)
        assert_good_request_works(server)
    r = requests.get(f"{server.base}/v2/nothing/here", timeout=10)
    assert (r.status_code, r.json()) == (404, {"error": "Not Found"})
    assert requests.delete(f"{server.base}/v2/models/mlp", timeout=10).status_code == 405
    with pytest.raises(InferenceServerException, match=r"unknown model|not found"):
        client(server).get_model_metadata("nope")
    assert_good_request_works(server)


# -- the rest of the API through tritonclient ------------------------------------------------------
def test_tritonclient_admin_api(server_factory: ServerFactory, tmp_path: Path) -> None:
    from tritonclient.utils import shared_memory as shm

    repo = mlp_repo(tmp_path)
    server = server_factory(repo)
    cli = client(server)
    assert cli.is_server_live() and cli.is_server_ready() and cli.is_model_ready("mlp")
    assert cli.is_model_ready("mlp", "1") and not cli.is_model_ready("mlp", "5")
    meta = cli.get_server_metadata()
    assert "model_repository" in meta["extensions"]
    model = cli.get_model_metadata("mlp")
    assert model["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    config = cli.get_model_config("mlp")
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert config["input"][0]["dims"] == [16]

    # system shared memory in and out, the way tritonclient does it
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    key = f"/edgeserve_http_{server.http_port}"
    handle = shm.create_shared_memory_region("io", key, 256)
    try:
        shm.set_shared_memory_region(handle, [x])
        cli.register_system_shared_memory("io", key, 256)
        assert cli.get_system_shared_memory_status()[0]["name"] == "io"
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_shared_memory("io", x.nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
        out.set_shared_memory("io", 32, offset=x.nbytes)
        result = cli.infer("mlp", [inp], outputs=[out])
        assert result.get_output("OUTPUT0")["parameters"]["shared_memory_region"] == "io"
        got = shm.get_contents_as_numpy(handle, np.float32, [2, 4], offset=x.nbytes)
        (want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": x})
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        cli.unregister_system_shared_memory("io")
        assert cli.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(handle)

    stats = cli.get_inference_statistics()
    assert stats["model_stats"][0]["name"] == "mlp"
    index = cli.get_model_repository_index()
    assert index[0]["name"] == "mlp" and index[0]["state"] == "READY"
    settings = cli.get_log_settings()
    assert settings["log_info"] is True
    assert cli.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
    assert cli.update_log_settings({"log_verbose_level": 0})["log_verbose_level"] == 0
    metrics = requests.get(f"{server.base}/metrics", timeout=10)
    assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
    assert 'nv_inference_request_success{model="mlp",version="1"} 1' in metrics.text
    assert 'nv_inference_count{model="mlp",version="1"} 2' in metrics.text
    # binary-only output of the raw request extension
    r = requests.post(
        f"{server.base}/v2/models/mlp/infer",
        data=x[:1].tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/octet-stream"
    length = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 16
    (want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": x[:1]})
    np.testing.assert_allclose(np.frombuffer(r.content[length:], dtype=np.float32), want[0], rtol=1e-6)
