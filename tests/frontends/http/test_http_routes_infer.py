"""HTTP inference routes on a real aiohttp server over a real DataPlane whose models are numpy
functions (http_fakes.py): JSON and binary tensors, raw requests, compression, limits, errors."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_fakes import MAX_INPUT, Api, add_sub_request, serving, split_binary

from edgeserve.protocol import datatypes


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with serving(tmp_path) as client:
        yield client


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


def _inputs(*names: str, datatype: str = "FP32", shape: tuple[int, int] = (1, 4)) -> dict[str, Any]:
    """A JSON request's inputs: each of `names` with `shape`, all ones."""
    size = shape[0] * shape[1]
    inputs = [{"name": n, "datatype": datatype, "shape": list(shape), "data": [1] * size} for n in names]
    return {"inputs": inputs}


@pytest.mark.parametrize(
    ("model", "change", "status", "needle"),
    [
        ("add_sub", _inputs("INPUT0", datatype="INT32", shape=(2, 4)), 400, "INT32"),
        ("add_sub", _inputs("INPUT0", "INPUT1", shape=(2, 5)), 400, "shape"),
        ("add_sub", _inputs("NOPE"), 400, "NOPE"),
        ("add_sub", _inputs("INPUT0"), 400, "INPUT1"),
        ("add_sub", _inputs("INPUT0", "INPUT1", shape=(9, 4)), 400, "batch"),
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
