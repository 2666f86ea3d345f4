"""Every HTTP route of the frontend, on a real aiohttp server over a real DataPlane whose models are
numpy functions (http_fakes.py): status codes, bodies and headers as Triton sends them."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import mmap
import os
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from http_fakes import FakeRepository, make_plane

from edgeserve.config import Settings
from edgeserve.frontends.http.server import HttpFrontend
from edgeserve.protocol import datatypes

MAX_INPUT = 1 << 20


class Api:
    def __init__(self, session: aiohttp.ClientSession, base: str, repo: FakeRepository) -> None:
        self.session = session
        self.base = base
        self.repo = repo

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        if body is not None:
            data = json.dumps(body).encode()
        async with self.session.request(method, self.base + path, data=data, headers=headers or {}) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def json(self, method: str, path: str, body: Any = None, status: int = 200, **kw: Any) -> Any:
        code, headers, raw = await self.call(method, path, body, **kw)
        assert code == status, raw
        if status >= 400:
            assert headers["Content-Type"].startswith("application/json")
            error = json.loads(raw)
            assert set(error) == {"error"} and error["error"]
            return error["error"]
        return json.loads(raw) if raw else None


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    plane, repo = make_plane(tmp_path)
    settings = Settings()
    settings.http.port = 0
    settings.http.max_input_bytes = MAX_INPUT
    frontend = HttpFrontend(plane, settings)
    await frontend.start()
    assert frontend.port != 0
    session = aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("Accept-Encoding",))
    try:
        yield Api(session, f"http://127.0.0.1:{frontend.port}", repo)
    finally:
        await session.close()
        await frontend.stop(5)


def add_sub_request(
    binary: bool = False, outputs: list[dict[str, Any]] | None = None, **params: Any
) -> tuple[bytes, dict[str, str], np.ndarray, np.ndarray]:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    if binary:
        inputs = [
            {"name": n, "datatype": "FP32", "shape": [2, 4], "parameters": {"binary_data_size": 32}}
            for n in ("INPUT0", "INPUT1")
        ]
    else:
        inputs = [
            {"name": "INPUT0", "datatype": "FP32", "shape": [2, 4], "data": a.tolist()},
            {"name": "INPUT1", "datatype": "FP32", "shape": [2, 4], "data": b.reshape(-1).tolist()},
        ]
    header: dict[str, Any] = {"id": "7", "inputs": inputs}
    if outputs is not None:
        header["outputs"] = outputs
    if params:
        header["parameters"] = params
    text = json.dumps(header).encode()
    if not binary:
        return text, {}, a, b
    return text + a.tobytes() + b.tobytes(), {"Inference-Header-Content-Length": str(len(text))}, a, b


def split_binary(headers: dict[str, str], raw: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(raw[:length])
    arrays, pos = {}, length
    for out in header["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if size is not None:
            arrays[out["name"]] = datatypes.from_buffer(
                raw[pos : pos + size], out["datatype"], tuple(out["shape"]), out["name"]
            )
            pos += size
    assert pos == len(raw)
    return header, arrays


# -- health, metadata, config, stats ------------------------------------------------------------------
async def test_health_metadata_config(api: Api) -> None:
    for path in (
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/add_sub/ready",
        "/v2/models/add_sub/versions/1/ready",
    ):
        status, _, body = await api.call("GET", path)
        assert (status, body) == (200, b"")
    assert "not ready" in await api.json("GET", "/v2/models/nope/ready", status=400)
    meta = await api.json("GET", "/v2")
    assert {"name", "version", "extensions"} <= set(meta) and "binary_tensor_data" in meta["extensions"]
    model = await api.json("GET", "/v2/models/add_sub")
    assert model["versions"] == ["1"]
    assert model["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}
    assert (await api.json("GET", "/v2/models/add_sub/versions/1"))["name"] == "add_sub"
    assert "unknown model" in await api.json("GET", "/v2/models/nope", status=404)
    assert "version 9" in await api.json("GET", "/v2/models/add_sub/versions/9/config", status=404)
    config = await api.json("GET", "/v2/models/add_sub/config")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [4]
    assert (
        config["input"][0]["data_type"] == "TYPE_FP32"
        and config["output"][0]["label_filename"] == "labels.txt"
    )


async def test_statistics_after_inference(api: Api) -> None:
    body, headers, _, _ = add_sub_request()
    assert (await api.call("POST", "/v2/models/add_sub/infer", data=body, headers=headers))[0] == 200
    stats = await api.json("GET", "/v2/models/add_sub/stats")
    (entry,) = stats["model_stats"]
    assert entry["name"] == "add_sub" and entry["version"] == "1" and entry["inference_count"] == 2
    assert entry["inference_stats"]["success"]["count"] == 1
    everything = await api.json("GET", "/v2/models/stats")
    assert {m["name"] for m in everything["model_stats"]} >= {"add_sub", "echo"}
    assert (await api.json("GET", "/v2/models/add_sub/versions/1/stats"))["model_stats"][0]["version"] == "1"
    assert "unknown model" in await api.json("GET", "/v2/models/nope/stats", status=404)


async def test_unknown_paths_and_methods(api: Api) -> None:
    assert await api.json("GET", "/v3/whatever", status=404) == "Not Found"
    assert await api.json("GET", "/v2/models/add_sub/versions/x/ready", status=404) == "Not Found"
    assert "Method Not Allowed" in await api.json("POST", "/v2/health/ready", status=405)
    assert "Method Not Allowed" in await api.json("GET", "/v2/models/add_sub/infer", status=405)
    assert "not supported" in await api.json("POST", "/v2/models/add_sub/generate", {}, status=501)


# -- inference ------------------------------------------------------------------------------------------
async def test_infer_json(api: Api) -> None:
    body, headers, a, b = add_sub_request()
    status, resp_headers, raw = await api.call("POST", "/v2/models/add_sub/infer", data=body, headers=headers)
    assert status == 200 and resp_headers["Content-Type"] == "application/json"
    assert "Inference-Header-Content-Length" not in resp_headers
    result = json.loads(raw)
    assert result["model_name"] == "add_sub" and result["model_version"] == "1" and result["id"] == "7"
    outs = {o["name"]: o for o in result["outputs"]}
    assert outs["OUTPUT0"]["shape"] == [2, 4] and outs["OUTPUT0"]["datatype"] == "FP32"
    np.testing.assert_allclose(outs["OUTPUT0"]["data"], (a + b).reshape(-1))
    np.testing.assert_allclose(outs["OUTPUT1"]["data"], (a - b).reshape(-1))


async def test_infer_binary_in_and_out(api: Api) -> None:
    body, headers, a, b = add_sub_request(binary=True, binary_data_output=True)
    status, resp_headers, raw = await api.call(
        "POST", "/v2/models/add_sub/versions/1/infer", data=body, headers=headers
    )
    assert status == 200 and resp_headers["Content-Type"] == "application/octet-stream"
    header, arrays = split_binary(resp_headers, raw)
    np.testing.assert_array_equal(arrays["OUTPUT0"], a + b)
    np.testing.assert_array_equal(arrays["OUTPUT1"], a - b)
    # per-output override: OUTPUT1 as JSON, only OUTPUT0 binary
    outputs = [
        {"name": "OUTPUT0", "parameters": {"binary_data": True}},
        {"name": "OUTPUT1", "parameters": {"binary_data": False}},
    ]
    body, headers, a, b = add_sub_request(binary=True, outputs=outputs)
    status, resp_headers, raw = await api.call("POST", "/v2/models/add_sub/infer", data=body, headers=headers)
    header, arrays = split_binary(resp_headers, raw)
    assert list(arrays) == ["OUTPUT0"] and header["outputs"][1]["data"] == (a - b).reshape(-1).tolist()


async def test_infer_selected_output_and_classification(api: Api) -> None:
    body, _, _, _ = add_sub_request(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 2}}])
    result = await api.json("POST", "/v2/models/add_sub/infer", data=body)
    (out,) = result["outputs"]
    assert out["name"] == "OUTPUT0" and out["datatype"] == "BYTES" and out["shape"] == [2, 2]
    assert out["data"][0] == "4.000000:3:three" and out["data"][1] == "3.000000:2:two"


async def test_infer_bytes_json_and_binary(api: Api) -> None:
    request = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["héllo", "wörld"]}]}
    result = await api.json("POST", "/v2/models/echo/infer", request)
    assert result["outputs"][0]["data"] == ["héllo", "wörld"]
    blob = datatypes.serialize_bytes(np.array([b"\x00\xff", b"x"], dtype=np.object_))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(blob)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    status, resp_headers, raw = await api.call(
        "POST",
        "/v2/models/echo/infer",
        data=header + blob,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200
    _, arrays = split_binary(resp_headers, raw)
    assert arrays["ECHO"].tolist() == [b"\x00\xff", b"x"]


async def test_raw_binary_request(api: Api) -> None:
    image = np.arange(12, dtype=np.uint8)
    status, headers, raw = await api.call(
        "POST",
        "/v2/models/image/infer",
        data=image.tobytes(),
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert status == 200
    _, arrays = split_binary(headers, raw)
    assert arrays["sum"].tolist() == [[int(image.sum())]]
    message = await api.json(
        "POST",
        "/v2/models/add_sub/infer",
        data=b"\0" * 32,
        status=400,
        headers={"Inference-Header-Content-Length": "0"},
    )
    assert "exactly one input" in message


async def test_compressed_request_and_response(api: Api) -> None:
    body, headers, a, b = add_sub_request(binary=True, binary_data_output=True)
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        status, resp_headers, raw = await api.call(
            "POST",
            "/v2/models/add_sub/infer",
            data=packed,
            headers={**headers, "Content-Encoding": encoding, "Accept-Encoding": encoding},
        )
        assert status == 200 and resp_headers["Content-Encoding"] == encoding
        plain = gzip.decompress(raw) if encoding == "gzip" else zlib.decompress(raw)
        _, arrays = split_binary(resp_headers, plain)
        np.testing.assert_array_equal(arrays["OUTPUT0"], a + b)
    bad = await api.json(
        "POST", "/v2/models/add_sub/infer", data=b"not gzip", status=400, headers={"Content-Encoding": "gzip"}
    )
    assert "decompress" in bad
    assert "Content-Encoding" in await api.json(
        "POST", "/v2/models/add_sub/infer", data=body, status=400, headers={"Content-Encoding": "br"}
    )


async def test_oversized_bodies_get_413(api: Api) -> None:
    message = await api.json("POST", "/v2/models/add_sub/infer", data=b"x" * (MAX_INPUT + 1), status=413)
    assert "exceeds the maximum" in message
    bomb = gzip.compress(b"\0" * (MAX_INPUT * 4))
    message = await api.json(
        "POST", "/v2/models/add_sub/infer", data=bomb, status=413, headers={"Content-Encoding": "gzip"}
    )
    assert "decompressed" in message
    assert (await api.call("GET", "/v2/health/live"))[0] == 200


@pytest.mark.parametrize(
    ("model", "change", "status", "needle"),
    [
        (
            "add_sub",
            {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [2, 4], "data": [1] * 8}]},
            400,
            "INT32",
        ),
        (
            "add_sub",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [2, 5], "data": [1] * 10},
                    {"name": "INPUT1", "datatype": "FP32", "shape": [2, 5], "data": [1] * 10},
                ]
            },
            400,
            "shape",
        ),
        (
            "add_sub",
            {"inputs": [{"name": "NOPE", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]},
            400,
            "NOPE",
        ),
        (
            "add_sub",
            {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]},
            400,
            "INPUT1",
        ),
        (
            "add_sub",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [9, 4], "data": [1] * 36},
                    {"name": "INPUT1", "datatype": "FP32", "shape": [9, 4], "data": [1] * 36},
                ]
            },
            400,
            "batch",
        ),
        ("add_sub", {"outputs": [{"name": "OUTPUT9"}]}, 400, "OUTPUT9"),
        ("nope", {}, 404, "unknown model"),
        ("full", {}, 503, "Exceeds maximum queue size"),
        ("crash", {}, 500, "backend exploded"),
        ("wrong", {}, 500, "OUTPUT1"),
    ],
)
async def test_infer_errors(api: Api, model: str, change: dict[str, Any], status: int, needle: str) -> None:
    body, _, _, _ = add_sub_request()
    request = {**json.loads(body), **change}
    assert needle in await api.json("POST", f"/v2/models/{model}/infer", request, status=status)
    ok, _, _, _ = add_sub_request()
    assert (await api.call("POST", "/v2/models/add_sub/infer", data=ok))[0] == 200


async def test_malformed_bodies(api: Api) -> None:
    for data, headers, needle in (
        (b"{", {}, "failed to parse"),
        (b'{"inputs": []}', {}, "inputs"),
        (b'{"inputs": 1}', {"Inference-Header-Content-Length": "99"}, "Inference-Header-Content-Length"),
        (b'{"inputs": 1}', {"Inference-Header-Content-Length": "abc"}, "Inference-Header-Content-Length"),
    ):
        assert needle in await api.json(
            "POST", "/v2/models/add_sub/infer", data=data, headers=headers, status=400
        )


# -- repository ----------------------------------------------------------------------------------------------
async def test_repository_index_load_unload(api: Api) -> None:
    index = await api.json("POST", "/v2/repository/index", data=b"")
    assert {"name": "add_sub", "version": "1", "state": "READY", "reason": ""} in index
    assert await api.json("POST", "/v2/repository/index", {"ready": True})
    assert "not supported" in await api.json("POST", "/v2/repository/other/index", {}, status=501)
    status, _, body = await api.call("POST", "/v2/repository/models/add_sub/load", data=b"")
    assert (status, body) == (200, b"")
    config = json.dumps({"max_batch_size": 4})
    files = {"file:2/model.onnx": base64.b64encode(b"\x08\x01").decode()}
    await api.json("POST", "/v2/repository/models/new/load", {"parameters": {"config": config, **files}})
    assert api.repo.loads[-1] == ("new", config, {"2/model.onnx": b"\x08\x01"})
    assert "base64" in await api.json(
        "POST",
        "/v2/repository/models/new/load",
        {"parameters": {"config": config, "file:1/model.onnx": "@@"}},
        status=400,
    )
    assert "'config'" in await api.json(
        "POST", "/v2/repository/models/new/load", {"parameters": files}, status=400
    )
    assert "must be a string" in await api.json(
        "POST", "/v2/repository/models/new/load", {"parameters": {"config": {"a": 1}}}, status=400
    )
    await api.json("POST", "/v2/repository/models/new/load", {"parameters": {"config": "{bad"}}, status=500)
    await api.json(
        "POST", "/v2/repository/models/add_sub/unload", {"parameters": {"unload_dependents": True}}
    )
    assert api.repo.unloads[-1] == ("add_sub", True)
    assert "no version" in await api.json("POST", "/v2/repository/models/nope/unload", status=404)


async def test_model_control_mode_none_refuses_load(api: Api, tmp_path: Path) -> None:
    plane, _ = make_plane(tmp_path)
    plane.model_control_mode = "none"
    settings = Settings()
    settings.http.port = 0
    frontend = HttpFrontend(plane, settings)
    await frontend.start()
    try:
        async with api.session.post(f"http://127.0.0.1:{frontend.port}/v2/repository/models/x/load") as resp:
            assert resp.status == 501 and "model control mode" in (await resp.json())["error"]
    finally:
        await frontend.stop(1)


# -- shared memory --------------------------------------------------------------------------------
async def test_system_shared_memory_round_trip(api: Api) -> None:
    key = f"edgeserve-test-{uuid.uuid4().hex[:8]}"
    fd = os.open(f"/dev/shm/{key}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 128)
        region = mmap.mmap(fd, 128)
        a = np.arange(4, dtype=np.float32)
        region[:16] = a.tobytes()
        region[16:32] = np.full(4, 2, dtype=np.float32).tobytes()
        await api.json(
            "POST", "/v2/systemsharedmemory/region/io/register", {"key": "/" + key, "byte_size": 128}
        )
        assert "already" in await api.json(
            "POST", "/v2/systemsharedmemory/region/io/register", {"key": key, "byte_size": 128}, status=400
        )
        assert await api.json("GET", "/v2/systemsharedmemory/status") == [
            {"name": "io", "key": "/" + key, "offset": 0, "byte_size": 128}
        ]
        assert len(await api.json("GET", "/v2/systemsharedmemory/region/io/status")) == 1
        assert "Unable to find" in await api.json("GET", "/v2/systemsharedmemory/region/x/status", status=404)
        shm = {"shared_memory_region": "io", "shared_memory_byte_size": 16}
        request = {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "parameters": {**shm}},
                {
                    "name": "INPUT1",
                    "datatype": "FP32",
                    "shape": [1, 4],
                    "parameters": {**shm, "shared_memory_offset": 16},
                },
            ],
            "outputs": [
                {"name": "OUTPUT0", "parameters": {**shm, "shared_memory_offset": 64, "binary_data": False}},
                {"name": "OUTPUT1"},
            ],
        }
        result = await api.json("POST", "/v2/models/add_sub/infer", request)
        out0, out1 = result["outputs"]
        assert "data" not in out0 and out0["parameters"]["shared_memory_region"] == "io"
        assert out0["parameters"]["shared_memory_offset"] == 64
        np.testing.assert_array_equal(np.frombuffer(region[64:80], dtype=np.float32), a + 2)
        assert out1["data"] == (a - 2).tolist()
        small = {
            **request,
            "outputs": [{"name": "OUTPUT0", "parameters": {**shm, "shared_memory_byte_size": 8}}],
        }
        assert "at least 16 bytes" in await api.json("POST", "/v2/models/add_sub/infer", small, status=500)
        past = {
            **request,
            "inputs": [
                {**request["inputs"][0], "parameters": {**shm, "shared_memory_offset": 120}},
                request["inputs"][1],
            ],
        }
        assert "Invalid offset" in await api.json("POST", "/v2/models/add_sub/infer", past, status=400)
        await api.json("POST", "/v2/systemsharedmemory/region/io/unregister")
        assert await api.json("GET", "/v2/systemsharedmemory/status") == []
        assert "Unable to find" in await api.json("POST", "/v2/models/add_sub/infer", request, status=404)
        await api.json("POST", "/v2/systemsharedmemory/unregister")
        assert "Unable to open" in await api.json(
            "POST",
            "/v2/systemsharedmemory/region/x/register",
            {"key": "/no-such-key-here", "byte_size": 8},
            status=500,
        )
        assert "byte_size" in await api.json(
            "POST", "/v2/systemsharedmemory/region/x/register", {"key": "k"}, status=400
        )
        assert await api.json("GET", "/v2/cudasharedmemory/status") == []
        assert "CUDA" in await api.json("POST", "/v2/cudasharedmemory/region/c/register", {}, status=501)
        region.close()
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{key}")


# -- logging, trace, metrics ----------------------------------------------------------------------
async def test_log_settings_change_real_levels(api: Api) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        settings = await api.json("GET", "/v2/logging")
        assert set(settings) == {
            "log_file",
            "log_info",
            "log_warning",
            "log_error",
            "log_verbose_level",
            "log_format",
        }
        updated = await api.json("POST", "/v2/logging", {"log_verbose_level": 1})
        assert updated["log_verbose_level"] == 1 and root.level == logging.DEBUG
        updated = await api.json("POST", "/v2/logging", {"log_verbose_level": 0, "log_info": False})
        assert root.level == logging.WARNING and updated["log_info"] is False
        await api.json("POST", "/v2/logging", {"log_format": "ISO8601"})
        assert "log_format" in await api.json("POST", "/v2/logging", {"log_format": "xml"}, status=400)
        assert "unknown log setting" in await api.json("POST", "/v2/logging", {"colour": True}, status=400)
        await api.json("POST", "/v2/logging", {"log_format": "default", "log_info": True})
        assert root.level == logging.INFO
    finally:
        root.setLevel(before)


async def test_trace_and_metrics(api: Api) -> None:
    assert (await api.json("GET", "/v2/trace/setting"))["trace_level"] == ["OFF"]
    assert (await api.json("GET", "/v2/models/add_sub/trace/setting"))["trace_level"] == ["OFF"]
    await api.json("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}, status=501)
    body, _, _, _ = add_sub_request()
    await api.call("POST", "/v2/models/add_sub/infer", data=body)
    status, headers, raw = await api.call("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    assert 'nv_inference_count{model="add_sub",version="1"} 2' in text
    assert "# TYPE nv_inference_request_success counter" in text
