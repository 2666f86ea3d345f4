"""End to end over HTTP: the real `python -m edgeserve run` on free loopback ports, driven by
tritonclient.http, requests and urllib; results compared with the runtimes called directly."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from onnx_models import write_model
from tritonclient.utils import InferenceServerException

from es_server import ROOT, RunningServer, ServerFactory

pytestmark = pytest.mark.timeout(300)

ORT = 'backend: "onnxruntime"\n'
MLP_CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }
output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""


def ort_run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def client(server: RunningServer, **kwargs: Any) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, **kwargs)


def mlp_infer(cli: httpclient.InferenceServerClient, x: np.ndarray, model: str = "mlp", **kwargs: Any) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = cli.infer(model, [inp], **kwargs)
    out = result.as_numpy("OUTPUT0")
    assert out is not None
    return out


def post_infer(server: RunningServer, model: str, body: Any, headers: dict[str, str] | None = None,
               path: str = "") -> requests.Response:  # fmt: skip
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{server.base}/v2/models/{model}{path}/infer", data=data, headers=headers or {}, timeout=60)


def json_mlp_request(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}]}


def assert_good_request_works(server: RunningServer, model: str = "mlp") -> None:
    x = np.ones((1, 16), dtype=np.float32)
    response = post_infer(server, model, json_mlp_request(x))
    assert response.status_code == 200, response.text
    assert server.alive()


# -- the outputs equal the runtimes called directly -------------------------------------------------------
def test_outputs_equal_onnxruntime_called_directly(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    write_model(repo, "add_sub", "add_sub", config=ORT)  # the rest of the config is auto-completed
    write_model(repo, "conv", "conv", config=ORT)  # dynamic H and W
    write_model(repo, "ids", "identity", datatype="INT64", config=ORT)
    server = server_factory(repo)
    cli = client(server)
    rng = np.random.default_rng(3)

    x = rng.standard_normal((3, 16)).astype(np.float32)
    (want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": x})
    np.testing.assert_allclose(mlp_infer(cli, x), want, rtol=1e-6, atol=1e-7)  # binary in and out
    response = post_infer(server, "mlp", json_mlp_request(x))  # JSON in and out
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    (out,) = response.json()["outputs"]
    assert out["shape"] == [3, 4] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"], dtype=np.float32).reshape(3, 4), want, rtol=1e-6, atol=1e-7)

    a, b = rng.standard_normal((2, 16)).astype(np.float32), rng.standard_normal((2, 16)).astype(np.float32)
    inputs = [httpclient.InferInput("INPUT0", [2, 16], "FP32"), httpclient.InferInput("INPUT1", [2, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b, binary_data=False)  # mixed JSON + binary inputs
    outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=False), httpclient.InferRequestedOutput("OUTPUT0")]
    result = cli.infer("add_sub", inputs, outputs=outputs, request_id="r-1")
    want_sum, want_diff = ort_run(repo / "add_sub/1/model.onnx", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), want_sum)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), want_diff)
    assert result.get_response()["id"] == "r-1" and result.get_response()["model_version"] == "1"

    image = rng.standard_normal((1, 3, 40, 56)).astype(np.float32)
    inp = httpclient.InferInput("images", list(image.shape), "FP32")
    inp.set_data_from_numpy(image)
    (want,) = ort_run(repo / "conv/1/model.onnx", {"images": image})
    np.testing.assert_allclose(cli.infer("conv", [inp]).as_numpy("features"), want, rtol=1e-5, atol=1e-6)

    ids = np.array([[2**40, -7, 0]], dtype=np.int64)
    inp = httpclient.InferInput("INPUT0", [1, 3], "INT64")
    inp.set_data_from_numpy(ids, binary_data=False)
    np.testing.assert_array_equal(cli.infer("ids", [inp]).as_numpy("OUTPUT0"), ids)


def test_openvino_backend_equals_openvino_called_directly(server_factory: ServerFactory, tmp_path: Path) -> None:
    import openvino as ov

    repo = tmp_path / "repo"
    config = 'backend: "openvino"\nparameters { key: "INFERENCE_PRECISION_HINT" value { string_value: "f32" } }\n'
    write_model(repo, "mlp_ov", "mlp", config=config)
    write_model(repo, "conv_ov", "conv", config=config)
    server = server_factory(repo)
    cli = client(server)
    config_json = cli.get_model_config("mlp_ov")
    assert config_json["backend"] == "openvino"
    core = ov.Core()
    rng = np.random.default_rng(5)

    x = rng.standard_normal((4, 16)).astype(np.float32)
    compiled = core.compile_model(str(repo / "mlp_ov/1/model.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    want = compiled({"INPUT0": x})[compiled.output(0)]
    np.testing.assert_allclose(mlp_infer(cli, x, model="mlp_ov"), want, rtol=1e-5, atol=1e-6)

    image = rng.standard_normal((2, 3, 24, 32)).astype(np.float32)
    compiled = core.compile_model(str(repo / "conv_ov/1/model.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    want = compiled({"images": image})[compiled.output(0)]
    inp = httpclient.InferInput("images", list(image.shape), "FP32")
    inp.set_data_from_numpy(image)
    np.testing.assert_allclose(cli.infer("conv_ov", [inp]).as_numpy("features"), want, rtol=1e-5, atol=1e-6)


def test_sample_repository_serves_and_matches_onnxruntime(server_factory: ServerFactory) -> None:
    """The README's first command serves models/; an infer on mlp and ppocr_det equals ORT."""
    from edgeserve.samples import prepare

    models = ROOT / "models"
    prepare(models)  # idempotent; scripts/test.sh has already run it
    server = server_factory(models, timeout=240)
    with urllib.request.urlopen(f"{server.base}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    response = post_infer(server, "mlp", json_mlp_request(x))
    assert response.status_code == 200, response.text
    (want,) = ort_run(models / "mlp/1/model.onnx", {"INPUT0": x})
    got = np.array(response.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    image = np.random.default_rng(0).random((1, 3, 320, 320), dtype=np.float32)
    inp = httpclient.InferInput("x", list(image.shape), "FP32")
    inp.set_data_from_numpy(image)
    result = client(server).infer("ppocr_det", [inp])
    (want,) = ort_run(models / "ppocr_det/1/model.onnx", {"x": image})
    np.testing.assert_allclose(result.as_numpy("sigmoid_0.tmp_0"), want, rtol=1e-4, atol=1e-5)
    index = {m["name"]: m for m in client(server).get_model_repository_index()}
    assert {"mlp", "ppocr_det", "ppocr_cls", "ppocr_rec"} <= set(index)
    assert all(index[m]["state"] == "READY" for m in ("mlp", "ppocr_det", "ppocr_cls", "ppocr_rec"))


# -- scheduling behaviour seen over HTTP --------------------------------------------------------------------
def test_dynamic_batching_forms_batches_under_concurrency(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo)
    x = np.random.default_rng(1).standard_normal((16, 1, 16)).astype(np.float32)
    (want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": x.reshape(16, 16)})
    cli = client(server, concurrency=16)
    pending = []
    for i in range(16):
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x[i])
        pending.append(cli.async_infer("mlp", [inp]))
    for i, request in enumerate(pending):
        np.testing.assert_allclose(request.get_result().as_numpy("OUTPUT0")[0], want[i], rtol=1e-5, atol=1e-6)
    stats = client(server).get_inference_statistics("mlp")["model_stats"][0]
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert stats["inference_count"] == 16 and stats["inference_stats"]["success"]["count"] == 16
    assert max(sizes) > 1, f"no batch was formed: {sizes}"
    assert stats["execution_count"] < 16


def _concurrent_posts(server: RunningServer, model: str, body: bytes, headers: dict[str, str],
                      count: int) -> list[requests.Response]:  # fmt: skip
    barrier = threading.Barrier(count)

    def one(_: int) -> requests.Response:
        barrier.wait(10)
        return requests.post(f"{server.base}/v2/models/{model}/infer", data=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _conv_body(size: int = 320) -> tuple[bytes, dict[str, str]]:
    image = np.random.default_rng(2).standard_normal((1, 3, size, size)).astype(np.float32)
    header = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(image.shape),
                                     "parameters": {"binary_data_size": image.nbytes}}]}).encode()  # fmt: skip
    return header + image.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def test_queue_overflow_is_503_and_the_server_stays_up(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    config = """
backend: "onnxruntime"
max_batch_size: 1
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
"""
    write_model(repo, "conv", "conv", config=config)
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo)
    body, headers = _conv_body(384)
    responses = _concurrent_posts(server, "conv", body, headers, 16)
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code != 200]
    assert rejected and codes.count(200) >= 1, codes
    for r in rejected:
        assert r.status_code == 503 and "Exceeds maximum queue size" in r.json()["error"], r.text
    assert_good_request_works(server)
    assert post_infer(server, "conv", body, headers).status_code == 200


def test_request_timeout_gives_an_error(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    config = """
backend: "onnxruntime"
max_batch_size: 1
dynamic_batching { default_queue_policy { allow_timeout_override: true } }
"""
    write_model(repo, "conv", "conv", config=config)
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo)
    body, headers = _conv_body(384)
    header_len = int(headers["Inference-Header-Content-Length"])
    request = json.loads(body[:header_len])
    request["parameters"] = {"timeout": 1000}  # 1 ms: those queued behind a ~10 ms inference expire
    header = json.dumps(request).encode()
    timed = header + body[header_len:]
    responses = _concurrent_posts(server, "conv", timed, {"Inference-Header-Content-Length": str(len(header))}, 12)
    failed = [r for r in responses if r.status_code != 200]
    assert failed, "no request timed out"
    for r in failed:
        assert r.status_code in (503, 504, 400) and "timeout" in r.json()["error"].lower(), r.text
    stats = client(server).get_inference_statistics("conv")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == len(failed)
    assert_good_request_works(server)


# -- zero-downtime reload ---------------------------------------------------------------------------------------
def test_reload_under_load_fails_no_request(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo)
    x = np.random.default_rng(4).standard_normal((1, 16)).astype(np.float32)
    body = json.dumps(json_mlp_request(x)).encode()
    stop = threading.Event()
    outcomes: list[tuple[int, str, str]] = []

    def hammer() -> None:
        session = requests.Session()
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            r = session.post(f"{server.base}/v2/models/mlp/infer", data=body, timeout=30)
            version = r.json().get("model_version", "") if r.status_code == 200 else ""
            outcomes.append((r.status_code, version, r.text if r.status_code != 200 else ""))

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(0.5)
        write_model(repo, "mlp", "mlp", version=2, seed=9)  # new weights
        r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
        assert r.status_code == 200, r.text
        time.sleep(0.5)
        new_config = {"max_batch_size": 4, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
                      "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
                      "dynamic_batching": {"max_queue_delay_microseconds": 1000}}  # fmt: skip
        r = requests.post(f"{server.base}/v2/repository/models/mlp/load",
                          json={"parameters": {"config": json.dumps(new_config)}}, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        time.sleep(0.5)
        # A failed reload (corrupt model file) keeps the old version serving.
        (repo / "mlp" / "3").mkdir()
        (repo / "mlp" / "3" / "model.onnx").write_bytes(b"this is not an onnx model")
        r = requests.post(f"{server.base}/v2/repository/models/mlp/load", timeout=120)
        assert r.status_code >= 400 and r.json()["error"], r.text
        time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    failures = [o for o in outcomes if o[0] != 200]
    assert not failures, failures[:5]
    versions = [o[1] for o in outcomes]
    assert len(outcomes) > 20 and "1" in versions and "2" in versions and versions[-1] == "2"
    assert requests.get(f"{server.base}/v2/models/mlp/config", timeout=10).json()["max_batch_size"] == 4
    (want,) = ort_run(repo / "mlp/2/model.onnx", {"INPUT0": x})
    np.testing.assert_allclose(mlp_infer(client(server), x), want, rtol=1e-6, atol=1e-7)
    assert server.alive()


def test_load_with_file_overrides_and_unload(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
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
    r = requests.post(f"{server.base}/v2/repository/models/uploaded2/load", timeout=120, json={
        "parameters": {"config": config, "file:1/model.onnx": base64.b64encode(onnx_bytes).decode()}})
    assert r.status_code == 200, r.text
    cli.unload_model("uploaded")
    assert not cli.is_model_ready("uploaded")
    with pytest.raises(InferenceServerException):
        mlp_infer(cli, x, model="uploaded")
    assert cli.is_model_ready("mlp") and server.alive()


# -- bad requests -------------------------------------------------------------------------------------------------
def test_bad_requests_get_4xx_with_a_clear_message(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    server = server_factory(repo, env={"EDGESERVE_HTTP_MAX_INPUT_BYTES": str(1 << 20)})
    good = json_mlp_request(np.ones((1, 16), dtype=np.float32))
    x16 = np.ones((1, 16), dtype=np.float32)
    binary_header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                            "parameters": {"binary_data_size": 64}}]}).encode()  # fmt: skip

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
        ("mlp", binary_header + x16.tobytes()[:60], {"Inference-Header-Content-Length": str(len(binary_header))},
         400, "binary_data_size"),
        ("mlp", binary_header + x16.tobytes(), {"Inference-Header-Content-Length": "12345678"}, 400,
         "Inference-Header-Content-Length"),
        ("mlp", binary_header + x16.tobytes(), {"Inference-Header-Content-Length": "nan"}, 400,
         "Inference-Header-Content-Length"),
        ("mlp", binary_header + x16.tobytes(), {}, 400, "JSON"),
        ("nope", good, {}, 404, "nope"),
        ("mlp/versions/7", good, {}, 404, "7"),
        ("mlp", b"x" * ((1 << 20) + 10), {}, 413, "exceeds"),
    ]  # fmt: skip
    for model, body, headers, status, needle in cases:
        r = post_infer(server, model, body, headers)
        assert r.status_code == status, (model, r.status_code, r.text)
        message = r.json()["error"]
        assert needle in message, (needle, message)
        assert_good_request_works(server)
    r = requests.get(f"{server.base}/v2/nothing/here", timeout=10)
    assert (r.status_code, r.json()) == (404, {"error": "Not Found"})
    assert requests.delete(f"{server.base}/v2/models/mlp", timeout=10).status_code == 405
    with pytest.raises(InferenceServerException, match="unknown model|not found"):
        client(server).get_model_metadata("nope")
    assert_good_request_works(server)


# -- the rest of the API through tritonclient -----------------------------------------------------------------
def test_tritonclient_admin_api(server_factory: ServerFactory, tmp_path: Path) -> None:
    from tritonclient.utils import shared_memory as shm

    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
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
    r = requests.post(f"{server.base}/v2/models/mlp/infer", data=x[:1].tobytes(),
                      headers={"Inference-Header-Content-Length": "0"}, timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/octet-stream"
    length = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 16
    (want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": x[:1]})
    np.testing.assert_allclose(np.frombuffer(r.content[length:], dtype=np.float32), want[0], rtol=1e-6)
