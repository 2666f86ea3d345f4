"""Issue 13 (overload): the server-wide in-flight bound (`[server] max_inflight`), end to end against a
real `edgeserve serve` with a slow model. A flood of concurrent requests over HTTP and gRPC, more than
the bound: every answer is a success or an explicit overload rejection (HTTP 503 / gRPC UNAVAILABLE
naming it), none hangs, and once the flood ends a request succeeds at once. Counts and statuses only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from es_server import RunningServer, ServerFactory
from slow_model import DIM, grpc_outcome, slow_repo

pytestmark = pytest.mark.timeout(240)

LAYERS = 48
LIMIT = 4
FLOOD = 48
OVERLOAD = "server overloaded"
QUEUE_FULL = "Exceeds maximum queue size"


def _start(server_factory: ServerFactory, tmp_path: Path) -> RunningServer:
    return server_factory(
        slow_repo(tmp_path, LAYERS, weights=0),
        env={
            "EDGESERVE_SERVER_MAX_INFLIGHT": str(LIMIT),
            "EDGESERVE_RUNTIME_CPU_THREADS": "1",
            "EDGESERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT": "256",
        },
    )


def _row() -> np.ndarray:
    return np.random.default_rng(1).random((1, DIM), dtype=np.float32)


async def _http_flood(server: RunningServer) -> tuple[list[tuple[int, str]], int]:
    url = f"{server.base}/v2/models/slow/infer"
    x = _row()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, DIM], "data": x.ravel().tolist()}]}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=FLOOD), timeout=timeout) as session:

        async def one() -> tuple[int, str]:
            async with session.post(url, json=body) as resp:
                return resp.status, await resp.text()

        results = await asyncio.gather(*(one() for _ in range(FLOOD)))
        # after the flood: the next request is served (the in-flight count went back to 0)
        async with session.post(url, json=body) as resp:
            after = resp.status
    return list(results), after


async def _grpc_flood(server: RunningServer) -> tuple[list[tuple[str, str]], str]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = _row()

    async def one() -> tuple[str, str]:
        return await grpc_outcome(client, x)

    try:
        results = await asyncio.gather(*(one() for _ in range(FLOOD)))
        after = await one()
    finally:
        await client.close()
    return list(results), after[0]


# transport -> (flood, success, refusal, what the refusal must also name)
FLOODS: dict[str, tuple[Callable[[RunningServer], Awaitable[tuple[list[Any], Any]]], Any, Any, str]] = {
    "http": (_http_flood, 200, 503, f"limit {LIMIT}"),
    "grpc": (_grpc_flood, "OK", "StatusCode.UNAVAILABLE", ""),
}


@pytest.mark.parametrize("transport", FLOODS)
def test_a_flood_is_served_or_refused_as_overload_and_recovers(
    server_factory: ServerFactory, tmp_path: Path, transport: str
) -> None:
    flood, ok, overloaded, detail = FLOODS[transport]
    server = _start(server_factory, tmp_path)
    results, after = asyncio.run(flood(server))
    outcomes = [outcome for outcome, _ in results]
    assert set(outcomes) <= {ok, overloaded}, results
    refused = [text for outcome, text in results if outcome == overloaded]
    assert all(OVERLOAD in text or QUEUE_FULL in text for text in refused), refused
    assert any(OVERLOAD in text and detail in text for text in refused), results
    assert 1 <= outcomes.count(ok) < FLOOD
    assert after == ok
    assert server.alive()
