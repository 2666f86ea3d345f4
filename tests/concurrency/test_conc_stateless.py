"""Concurrent clients on stateless models with dynamic batching: ONNX Runtime, OpenVINO (the same
ONNX file), a Python model, the response cache on (and off: every other model), an ensemble of
Python steps around an ONNX step; over every wire of conc_wires.py: HTTP (binary and JSON tensors),
gRPC unary, gRPC stream, ZeroMQ inline, ZeroMQ through the shm frame ring, and one asyncio client per
wire shared by many threads (tritonclient.grpc.aio, tritonclient.http.aio, AsyncZmqClient). Every row
of every answer is checked against the client's own reference; a wrong one is traced to the request
it belongs to. A Python model also answers each row's request_id().

Replay a seed: EDGESERVE_CONC_SEEDS=<seed> pytest tests/concurrency/test_conc_stateless.py
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conc_models import SLOW, STATELESS, Repository
from conc_server import SEEDS_ENV, endpoints, seeds, start
from conc_transports import DEADLINE_WIRES
from conc_wires import TRANSPORTS
from es_server import RunningServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import Mix, run_clients

pytestmark = pytest.mark.timeout(300)

CLIENTS = 48
OPS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("conc_stateless")
    running = start(Repository(tmp / "models", stateless=(*STATELESS, *SLOW)), tmp)
    yield running
    running.stop()


def _get(server: RunningServer, path: str) -> Any:
    with urllib.request.urlopen(server.base + path, timeout=30) as response:
        return json.load(response)


def _stats(server: RunningServer, model: str) -> dict[str, Any]:
    stats: dict[str, Any] = _get(server, f"/v2/models/{model}/stats")["model_stats"][0]["inference_stats"]
    return stats


@pytest.mark.parametrize("seed", seeds((101, 102)))
def test_every_client_gets_its_own_answers(server: RunningServer, seed: int) -> None:
    hits_before = _stats(server, "affine_cached")["cache_hit"]["count"]
    report = run_clients(
        endpoints(server), seed, CLIENTS, Mix(stateless=STATELESS), run=seed, ops_per_client=OPS
    )
    replay = f"{SEEDS_ENV}={seed} pytest tests/concurrency/test_conc_stateless.py"
    assert report.ok, report.render(replay)
    assert report.ops == CLIENTS * OPS, report.render(replay)
    assert set(report.by_transport) == set(TRANSPORTS)
    assert server.alive(), server.log()[-4000:]
    # The cache path ran: a client's repeat of its own earlier request is answered from the cache.
    assert _stats(server, "affine_cached")["cache_hit"]["count"] > hits_before


@pytest.mark.parametrize("seed", seeds((103,)))
def test_calls_that_give_up_never_leak_into_later_answers(server: RunningServer, seed: int) -> None:
    """Clients give some calls a 1-10 ms deadline on a model that sleeps 0-14 ms: those give up
    (DEADLINE_EXCEEDED) and their answers come late, onto connections and sockets the client goes on
    using; every answer a client does take must still be its own."""
    mix = Mix(stateless=(*SLOW, STATELESS[0]), p_deadline=0.4, transports=tuple(sorted(DEADLINE_WIRES)))
    report = run_clients(endpoints(server), seed, 30, mix, run=seed, ops_per_client=10)
    replay = f"{SEEDS_ENV}={seed} pytest tests/concurrency/test_conc_stateless.py -k give_up"
    assert report.ok, report.render(replay)
    assert report.notes["gave up: client deadline"] > 0, report.summary()  # else this proves nothing
    assert server.alive(), server.log()[-4000:]


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    names=st.sets(st.sampled_from([m.name for m in STATELESS]), min_size=1),
    max_rows=st.integers(1, 8),
    max_burst=st.integers(1, 8),
    clients=st.integers(16, 64),
    seed=st.integers(0, 2**31),
)
def test_any_mix_of_models_rows_and_bursts(
    server: RunningServer, names: set[str], max_rows: int, max_burst: int, clients: int, seed: int
) -> None:
    """Hypothesis picks the models, rows per request (up to max_batch_size), calls in flight per client
    and the number of clients; a failure shrinks to the smallest workload that still goes wrong."""
    models = tuple(m for m in STATELESS if m.name in names)
    mix = Mix(stateless=models, max_rows=max_rows, max_burst=max_burst, max_think_ms=1.0)
    report = run_clients(endpoints(server), seed, clients, mix, run=seed % 64, ops_per_client=6)
    assert report.ok, report.render(f"the falsifying example below; models {sorted(names)}")


def test_the_models_run_where_the_suite_says(server: RunningServer) -> None:
    """Guards the coverage: OpenVINO really serves affine_ov, the ensemble's steps are Python."""
    assert _get(server, "/v2/models/affine_ov/config")["backend"] == "openvino"
    assert _get(server, "/v2/models/affine_py/config")["backend"] == "python"
    assert _get(server, "/v2/models/ens_py_pre/config")["backend"] == "python"
    assert _get(server, "/v2/models/affine_cached/config")["response_cache"]["enable"] is True
    assert not _get(server, "/v2/models/affine_ort/config").get("response_cache", {}).get("enable")
