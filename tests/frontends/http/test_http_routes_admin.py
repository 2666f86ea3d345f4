"""HTTP routes other than inference, on a real aiohttp server over a real DataPlane (http_fakes.py):
health, metadata, config, statistics, repository, shared memory, logging, trace, metrics, 404/405."""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from http_fakes import Api, add_sub_request, make_plane, serving

from edgeserve.config import Settings
from edgeserve.frontends.http.server import HttpFrontend


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with serving(tmp_path) as client:
        yield client


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
    # the generate extension (generate.py): a body without the model's inputs is the data plane's 400
    assert "INPUT0" in await api.json("POST", "/v2/models/add_sub/generate", {}, status=400)


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
        assert "at least 16 bytes" in await api.json("POST", "/v2/models/add_sub/infer", small, status=400)
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
            status=404,
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
