"""Concurrent clients running interleaved sequences on stateful models: the Direct and Oldest
strategies, with and without a batch axis, implicit state (the running sum), control inputs of every
datatype Triton allows (START / END / READY as int32, fp32 and bool with their own false/true values;
CORRID as uint64, int64, uint32, int32 and string), ONNX Runtime and Python models; over HTTP, gRPC
unary, gRPC stream (a sequence's steps pipelined on the stream), ZeroMQ inline and through the shm
frame ring. Every step's sum and every control value the model saw is checked against the client's
own bookkeeping; an ID is sometimes started again after its END (its state must restart).

Replay a seed: EDGESERVE_CONC_SEEDS=<seed> pytest tests/concurrency/test_conc_sequence.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conc_models import SEQUENCES, Repository
from conc_server import SEEDS_ENV, endpoints, seeds, start
from es_server import RunningServer
from workload import Mix, run_clients

pytestmark = pytest.mark.timeout(300)

CLIENTS = 32
OPS = 6
ONNX = tuple(s for s in SEQUENCES if s.backend == "onnxruntime")
PYTHON = tuple(s for s in SEQUENCES if s.backend == "python")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("conc_sequence")
    running = start(Repository(tmp / "models", sequences=SEQUENCES), tmp)
    yield running
    running.stop()


def _round(server: RunningServer, seed: int, mix: Mix, test: str) -> None:
    report = run_clients(endpoints(server), seed, CLIENTS, mix, run=seed % 64, ops_per_client=OPS)
    replay = f"{SEEDS_ENV}={seed} pytest 'tests/concurrency/test_conc_sequence.py::{test}'"
    assert report.ok, report.render(replay)
    assert report.ops == CLIENTS * OPS, report.render(replay)
    assert server.alive(), server.log()[-4000:]


@pytest.mark.parametrize("seed", seeds((201, 202)))
def test_onnx_sequences_keep_their_state_and_controls(server: RunningServer, seed: int) -> None:
    _round(server, seed, Mix(sequences=ONNX), "test_onnx_sequences_keep_their_state_and_controls")


@pytest.mark.parametrize("seed", seeds((203,)))
def test_python_sequences_get_one_request_per_step(server: RunningServer, seed: int) -> None:
    _round(server, seed, Mix(sequences=PYTHON), "test_python_sequences_get_one_request_per_step")


@pytest.mark.parametrize("seed", seeds((204,)))
def test_sequences_and_every_strategy_at_once(server: RunningServer, seed: int) -> None:
    """All sequence models in one round: the clients hop between models and wires."""
    _round(server, seed, Mix(sequences=SEQUENCES, max_steps=5), "test_sequences_and_every_strategy_at_once")
