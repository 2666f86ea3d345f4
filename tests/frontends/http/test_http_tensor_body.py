"""HTTP binary tensors read without extra copies (tensor_body.py, issue 36): the request body lands in one
buffer whose binary part starts 64-byte aligned, and the decoded inputs are aligned, writable views of
it, whatever the JSON header's length; compressed and chunked bodies take the ordinary path. Real aiohttp
servers and clients on loopback; the end-to-end half drives the real server with tritonclient.http."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.http as httpclient
from aiohttp import web
from es_server import ServerFactory
from http_e2e_helpers import client, mlp_repo, ort_run
from onnx_models import ORT, write_model

from edgeserve.frontends.http import codec
from edgeserve.frontends.http.tensor_body import TENSOR_ALIGN, read_tensor_body

pytestmark = pytest.mark.timeout(300)
MAX_BYTES = 64 << 20


def binary_request(arrays: dict[str, np.ndarray], request_id: str) -> tuple[bytes, int]:
    """A binary-tensor infer body (its JSON header, then the raw tensors) and its header's length."""
    header = {
        "id": request_id,  # its length moves where the binary part starts
        "inputs": [
            {
                "name": name,
                "datatype": "FP32",
                "shape": list(a.shape),
                "parameters": {"binary_data_size": a.nbytes},
            }
            for name, a in arrays.items()
        ],
    }
    head = json.dumps(header).encode()
    return head + b"".join(a.tobytes() for a in arrays.values()), len(head)


async def _serve_and_post(bodies: list[tuple[bytes, dict[str, str]]], chunked: bool = False) -> list[Any]:
    """POST each body to a real aiohttp server whose handler reads it as the infer route does and
    answers what the decoded tensors look like."""

    async def handler(request: web.Request) -> web.Response:
        body = await read_tensor_body(request, MAX_BYTES)
        fallback = body is None
        if body is None:
            body = await request.read()
        header_length = codec.parse_header_length(request.headers.get(codec.HEADER_LENGTH), len(body))
        decoded, _ = codec.decode_request("m", "", body, header_length)
        report = [
            {
                "aligned": t.data.ctypes.data % TENSOR_ALIGN == 0,
                "writeable": bool(t.data.flags.writeable),
                "views_body": np.shares_memory(t.data, np.frombuffer(body, np.uint8)),
                "sum": float(np.asarray(t.data, np.float64).sum()),
            }
            for t in decoded.inputs
        ]
        return web.json_response({"fallback": fallback, "inputs": report})

    app = web.Application(client_max_size=MAX_BYTES)
    app.router.add_post("/infer", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for body, headers in bodies:

                async def pieces(data: bytes = body) -> Any:  # no Content-Length: chunked encoding
                    for i in range(0, len(data), 65536):
                        yield data[i : i + 65536]

                payload: Any = pieces() if chunked else body
                async with session.post(f"http://127.0.0.1:{port}/infer", data=payload, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    answers.append(await r.json())
    finally:
        await runner.cleanup()
    return answers


async def test_binary_inputs_are_aligned_writable_views_of_the_body_whatever_the_header_length() -> None:
    rng = np.random.default_rng(0)
    frame = rng.random((1, 224, 224, 3), dtype=np.float32)  # 600 KB: many socket chunks
    small = rng.random((1, 3), dtype=np.float32)  # 12 bytes: the next input starts 12 bytes on
    bodies = []
    for pad in range(8):  # header lengths over every residue mod 4 and 8
        body, head = binary_request({"IMAGE": frame, "SMALL": small, "AFTER": small}, "x" * pad)
        bodies.append((body, {codec.HEADER_LENGTH: str(head), "Content-Type": "application/octet-stream"}))
    answers = await _serve_and_post(bodies)
    for answer in answers:
        assert answer["fallback"] is False
        image, first_small, second_small = answer["inputs"]
        assert image["aligned"] and image["writeable"] and image["views_body"]
        assert first_small["aligned"]  # right after a 64-multiple tensor
        assert second_small["views_body"] and second_small["writeable"]
        assert image["sum"] == pytest.approx(float(frame.astype(np.float64).sum()), rel=1e-9)
        assert first_small["sum"] == pytest.approx(float(small.astype(np.float64).sum()), rel=1e-9)


async def test_compressed_and_chunked_bodies_take_the_ordinary_path() -> None:
    frame = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    body, head = binary_request({"X": frame}, "id")
    gz = (gzip.compress(body), {codec.HEADER_LENGTH: str(head), "Content-Encoding": "gzip"})
    (gz_answer,) = await _serve_and_post([gz])
    assert gz_answer["fallback"] is True  # read_body decompresses it (the handler here only reads)
    (chunked,) = await _serve_and_post([(body, {codec.HEADER_LENGTH: str(head)})], chunked=True)
    assert chunked["fallback"] is True
    assert chunked["inputs"][0]["sum"] == float(frame.astype(np.float64).sum())


def test_tritonclient_binary_inputs_answer_as_onnxruntime(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """tritonclient.http binary_data inputs of several sizes (each moves the next tensor's offset), one and
    two inputs, a batch of several rows, and a gzip-compressed request: each answer equals ONNX Runtime."""
    repo = mlp_repo(tmp_path)
    write_model(repo, "add_sub", "add_sub", config=ORT)
    server = server_factory(repo)
    cli = client(server)
    rng = np.random.default_rng(7)
    for rows in (1, 3, 4):  # add_sub batches up to 4
        a = rng.standard_normal((rows, 16)).astype(np.float32)
        b = rng.standard_normal((rows, 16)).astype(np.float32)
        inputs = [
            httpclient.InferInput("INPUT0", [rows, 16], "FP32"),
            httpclient.InferInput("INPUT1", [rows, 16], "FP32"),
        ]
        inputs[0].set_data_from_numpy(a, binary_data=True)
        inputs[1].set_data_from_numpy(b, binary_data=True)
        want = ort_run(repo / "add_sub/1/model.onnx", {"INPUT0": a, "INPUT1": b})
        for compression in (None, "gzip"):
            result = cli.infer(
                "add_sub", inputs, request_id="r" * rows, request_compression_algorithm=compression
            )
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), want[0], rtol=1e-6)
            np.testing.assert_allclose(result.as_numpy("OUTPUT1"), want[1], rtol=1e-6)
        single = httpclient.InferInput("INPUT0", [rows, 16], "FP32")
        single.set_data_from_numpy(a, binary_data=True)
        (mlp_want,) = ort_run(repo / "mlp/1/model.onnx", {"INPUT0": a})
        np.testing.assert_allclose(
            cli.infer("mlp", [single]).as_numpy("OUTPUT0"), mlp_want, rtol=1e-6, atol=1e-7
        )
