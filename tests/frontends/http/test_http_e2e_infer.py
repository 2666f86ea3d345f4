"""End to end over HTTP, inference: the real `python -m edgeserve run` on free loopback ports, driven
by tritonclient.http, requests and urllib; results equal the runtimes called directly; batching,
queue overflow and timeouts as seen by clients."""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from es_server import ROOT, RunningServer, ServerFactory
from http_e2e_helpers import (
    MLP_CONFIG,
    assert_good_request_works,
    client,
    json_mlp_request,
    mlp_infer,
    mlp_repo,
    ort_run,
    post_infer,
)
from onnx_models import ORT, write_model

pytestmark = pytest.mark.timeout(300)


# -- the outputs equal the runtimes called directly ------------------------------------------------
def test_outputs_equal_onnxruntime_called_directly(server_factory: ServerFactory, tmp_path: Path) -> None:
    repo = mlp_repo(tmp_path)
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
    np.testing.assert_allclose(
        np.array(out["data"], dtype=np.float32).reshape(3, 4), want, rtol=1e-6, atol=1e-7
    )

    a, b = rng.standard_normal((2, 16)).astype(np.float32), rng.standard_normal((2, 16)).astype(np.float32)
    inputs = [
        httpclient.InferInput("INPUT0", [2, 16], "FP32"),
        httpclient.InferInput("INPUT1", [2, 16], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b, binary_data=False)  # mixed JSON + binary inputs
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
        httpclient.InferRequestedOutput("OUTPUT0"),
    ]
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


def test_openvino_backend_equals_openvino_called_directly(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    import openvino as ov

    repo = tmp_path / "repo"
    config = (
        'backend: "openvino"\nparameters { key: "INFERENCE_PRECISION_HINT" value { string_value: "f32" } }\n'
    )
    # Big enough (> 64 KiB of weights) that no profile's size floor for OpenVINO could apply.
    write_model(repo, "mlp_ov", "mlp", config=config, hidden=1024)
    write_model(repo, "conv_ov", "conv", config=config, out_channels=768)
    server = server_factory(repo)
    cli = client(server)
    config_json = cli.get_model_config("mlp_ov")
    assert config_json["backend"] == "openvino"
    core = ov.Core()
    rng = np.random.default_rng(5)

    x = rng.standard_normal((4, 16)).astype(np.float32)
    compiled = core.compile_model(
        str(repo / "mlp_ov/1/model.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    want = compiled({"INPUT0": x})[compiled.output(0)]
    np.testing.assert_allclose(mlp_infer(cli, x, model="mlp_ov"), want, rtol=1e-5, atol=1e-6)

    image = rng.standard_normal((2, 3, 16, 24)).astype(np.float32)
    compiled = core.compile_model(
        str(repo / "conv_ov/1/model.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
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


# -- scheduling behaviour seen over HTTP -----------------------------------------------------------
def test_dynamic_batching_forms_batches_under_concurrency(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    repo = mlp_repo(tmp_path)
    # A batching window no arrival misses (a minute): the batch runs once its 16 rows (max_batch_size)
    # are there, however slowly a busy box sends them, so 16 concurrent requests make exactly one.
    config = MLP_CONFIG.replace("max_batch_size: 8", "max_batch_size: 16")
    write_model(repo, "mlp16", "mlp", config=config.replace("20000", "60000000"))
    server = server_factory(repo)
    x = np.random.default_rng(1).standard_normal((16, 1, 16)).astype(np.float32)
    (want,) = ort_run(repo / "mlp16/1/model.onnx", {"INPUT0": x.reshape(16, 16)})
    cli = client(server, concurrency=16)
    pending = []
    for i in range(16):
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x[i])
        pending.append(cli.async_infer("mlp16", [inp]))
    for i, request in enumerate(pending):
        np.testing.assert_allclose(request.get_result().as_numpy("OUTPUT0")[0], want[i], rtol=1e-5, atol=1e-6)
    stats = client(server).get_inference_statistics("mlp16")["model_stats"][0]
    sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert stats["inference_count"] == 16 and stats["inference_stats"]["success"]["count"] == 16
    assert sizes == {16: 1} and stats["execution_count"] == 1


def _concurrent_posts(
    server: RunningServer, model: str, body: bytes, headers: dict[str, str], count: int
) -> list[requests.Response]:
    barrier = threading.Barrier(count)

    def one(_: int) -> requests.Response:
        barrier.wait(10)
        return requests.post(f"{server.base}/v2/models/{model}/infer", data=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _conv_body(size: int = 320) -> tuple[bytes, dict[str, str]]:
    image = np.random.default_rng(2).standard_normal((1, 3, size, size)).astype(np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "images",
                    "datatype": "FP32",
                    "shape": list(image.shape),
                    "parameters": {"binary_data_size": image.nbytes},
                }
            ]
        }
    ).encode()
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
    responses = _concurrent_posts(
        server, "conv", timed, {"Inference-Header-Content-Length": str(len(header))}, 12
    )
    failed = [r for r in responses if r.status_code != 200]
    assert failed, "no request timed out"
    for r in failed:
        assert r.status_code in (503, 504, 400) and "timeout" in r.json()["error"].lower(), r.text
    stats = client(server).get_inference_statistics("conv")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == len(failed)
    assert_good_request_works(server)


def test_response_compression_only_where_it_pays(server_factory: ServerFactory, tmp_path: Path) -> None:
    """A client that accepts gzip (aiohttp and requests send it by default) gets float noise as
    identity (deflate would cost ~1.5 ms per 64 KB to save ~10%), a compressible body gzipped, and
    gzip whenever it refuses identity; every body decodes to the model's output."""
    import gzip

    repo = tmp_path / "repo"
    write_model(repo, "ident", "identity", config=ORT)
    server = server_factory(repo)
    rng = np.random.default_rng(5)

    def roundtrip(x: np.ndarray, accept: str) -> tuple[str | None, np.ndarray]:
        header = json.dumps({
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape),
                        "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }).encode()  # fmt: skip
        request = urllib.request.Request(
            f"{server.base}/v2/models/ident/infer",
            data=header + x.tobytes(),
            headers={"Inference-Header-Content-Length": str(len(header)), "Accept-Encoding": accept},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            encoding = response.headers.get("Content-Encoding")
            length = int(response.headers["Inference-Header-Content-Length"])
            raw = response.read()
        body = gzip.decompress(raw) if encoding == "gzip" else raw
        (out,) = json.loads(body[:length])["outputs"]
        return encoding, np.frombuffer(body[length:], np.float32).reshape(out["shape"])

    noise = rng.standard_normal((2, 8192)).astype(np.float32)  # 64 KB
    encoding, y = roundtrip(noise, "gzip, deflate")
    assert encoding is None
    np.testing.assert_array_equal(y, noise)
    mask = np.zeros((2, 8192), np.float32)
    mask[1, 100:900] = 1.0
    encoding, y = roundtrip(mask, "gzip, deflate")
    assert encoding == "gzip"
    np.testing.assert_array_equal(y, mask)
    for refusal in ("gzip, identity;q=0", "gzip;q=1, *;q=0"):
        encoding, y = roundtrip(noise, refusal)
        assert encoding == "gzip", refusal
        np.testing.assert_array_equal(y, noise)
    small = rng.standard_normal((1, 8)).astype(np.float32)  # small bodies: compressed as asked
    encoding, y = roundtrip(small, "gzip")
    assert encoding == "gzip"
    np.testing.assert_array_equal(y, small)
