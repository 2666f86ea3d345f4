"""A real DataPlane over the in-memory repository of `fake_plane`, so the HTTP routes can be tested
without the repository, scheduler or backends; plus the HttpFrontend serving it and a raw client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from fake_plane import FakeRepository, fake_plane

from edgeserve.config import Settings
from edgeserve.frontends.http.server import HttpFrontend
from edgeserve.protocol import datatypes
from edgeserve.server.dataplane import DataPlane

ADD_SUB = """
max_batch_size: 8
input { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }
input { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" }
output { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
"""
IDENTITY_BYTES = """
input { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }
output { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] }
"""
IMAGE = """
max_batch_size: 4
input { name: "image" data_type: TYPE_UINT8 dims: [ -1, 3 ] }
output { name: "sum" data_type: TYPE_INT64 dims: [ 1 ] }
"""


def add_sub(inputs: dict[str, Any]) -> dict[str, Any]:
    a, b = inputs["INPUT0"], inputs["INPUT1"]
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


def make_plane(tmp: Path) -> tuple[DataPlane, FakeRepository]:
    (tmp / "labels.txt").write_text("zero\none\ntwo\nthree\n")
    repo = FakeRepository(tmp)
    repo.add("add_sub", ADD_SUB, add_sub)
    repo.add("echo", IDENTITY_BYTES, lambda x: {"ECHO": x["TEXT"]})
    repo.add(
        "image", IMAGE, lambda x: {"sum": x["image"].reshape(x["image"].shape[0], -1).sum(1, keepdims=True)}
    )
    repo.add("full", ADD_SUB, add_sub, mode="full")
    repo.add("crash", ADD_SUB, add_sub, mode="crash")
    repo.add("wrong", ADD_SUB, lambda x: {"OUTPUT0": np.zeros(1)})  # forgets OUTPUT1
    return fake_plane(repo), repo


# -- the frontend and a raw client -------------------------------------------------------------------
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


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Api]:
    """An HttpFrontend on a free loopback port over `make_plane`, and a raw aiohttp client for it."""
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
        repo.close()


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
