"""Issue 13 (overload): a full model queue refuses a request before its body is read or decoded, on a
real `edgeserve serve`. While a flood keeps a slow model's queue full, a request whose body is garbage
gets the overload answer (HTTP 503 / gRPC UNAVAILABLE "Exceeds maximum queue size"), not the 400 its
body deserves: proof that the refusal spent nothing on decoding. Once the flood ends, the same garbage
gets its 400 / INVALID_ARGUMENT, and a correct request is served. Statuses only, no timings.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from es_server import RunningServer, ServerFactory
from slow_model import DIM, grpc_outcome, slow_repo

pytestmark = pytest.mark.timeout(240)

LAYERS = 600  # a few ms per row on one thread
QUEUE_OF_2 = "dynamic_batching { default_queue_policy { max_queue_size: 2 } }\n"
QUEUE_FULL = "Exceeds maximum queue size"
FLOODERS = 8
TRIES = 200


def _start(server_factory: ServerFactory, tmp_path: Path) -> RunningServer:
    return server_factory(
        slow_repo(tmp_path, LAYERS, weights=4, config=QUEUE_OF_2),
        env={"EDGESERVE_RUNTIME_CPU_THREADS": "1", "EDGESERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT": "256"},
    )


def _body() -> dict[str, object]:
    x = np.random.default_rng(1).random((1, DIM), dtype=np.float32)
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, DIM], "data": x.ravel().tolist()}]}


async def _flood(url: str, session: aiohttp.ClientSession, stop: asyncio.Event) -> list[int]:
    statuses: list[int] = []

    async def sender() -> None:
        while not stop.is_set():
            async with session.post(url, json=_body()) as resp:
                await resp.read()
                statuses.append(resp.status)

    await asyncio.gather(*(sender() for _ in range(FLOODERS)))
    return statuses


async def _http_case(server: RunningServer) -> tuple[list[int], list[tuple[int, str]], int, int]:
    url = f"{server.base}/v2/models/slow/infer"
    garbage = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [1, 2'
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(url, session, stop))
        answers: list[tuple[int, str]] = []
        try:
            for _ in range(TRIES):
                async with session.post(url, data=garbage) as resp:
                    answers.append((resp.status, await resp.text()))
                if answers[-1][0] == 503:
                    break
                await asyncio.sleep(0.01)
        finally:
            stop.set()
            statuses = await flood
        async with session.post(url, data=garbage) as resp:
            after_garbage = resp.status
        async with session.post(url, json=_body()) as resp:
            after = resp.status
    return statuses, answers, after_garbage, after


def test_http_full_queue_refuses_before_reading_the_body(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = _start(server_factory, tmp_path)
    statuses, answers, after_garbage, after = asyncio.run(_http_case(server))
    assert set(statuses) <= {200, 503} and 200 in statuses, statuses
    assert {status for status, _ in answers} <= {400, 503}, answers
    status, text = answers[-1]
    assert status == 503 and QUEUE_FULL in text, answers  # garbage body, never decoded
    assert after_garbage == 400 and after == 200
    assert server.alive()


async def _grpc_case(server: RunningServer) -> tuple[list[tuple[str, str]], str, str]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    good = np.random.default_rng(1).random((1, DIM), dtype=np.float32)
    wrong = np.zeros((1, 3), dtype=np.float32)  # a shape the model refuses once decoded

    async def call(x: np.ndarray) -> tuple[str, str]:
        return await grpc_outcome(client, x)

    stop = asyncio.Event()

    async def sender() -> None:
        while not stop.is_set():
            await call(good)

    flood = [asyncio.create_task(sender()) for _ in range(FLOODERS)]
    answers: list[tuple[str, str]] = []
    try:
        for _ in range(TRIES):
            answers.append(await call(wrong))
            if answers[-1][0] == "StatusCode.UNAVAILABLE":
                break
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        for task in flood:
            with contextlib.suppress(Exception):
                await task
    after_wrong = (await call(wrong))[0]
    after = (await call(good))[0]
    await client.close()
    return answers, after_wrong, after


def test_grpc_full_queue_refuses_before_decoding(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = _start(server_factory, tmp_path)
    answers, after_wrong, after = asyncio.run(_grpc_case(server))
    assert {code for code, _ in answers} <= {"StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"}
    code, message = answers[-1]
    assert code == "StatusCode.UNAVAILABLE" and QUEUE_FULL in message, answers
    assert after_wrong == "StatusCode.INVALID_ARGUMENT" and after == "OK"
    assert server.alive()
