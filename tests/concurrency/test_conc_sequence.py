"""Concurrent clients running interleaved sequences on stateful models: the Direct and Oldest
strategies, with and without a batch axis, implicit state (the running sum), control inputs of every
datatype Triton allows (START / END / READY as int32, fp32 and bool with their own false/true values;
CORRID as uint64, int64, uint32, int32 and string), ONNX Runtime and Python models; over every wire
(conc_wires.py), a sequence's steps pipelined where the wire keeps their order (gRPC stream, ZeroMQ).
Every step's sum and every control value the model saw is checked against the client's own
bookkeeping; an ID is sometimes started again after its END (its state must restart). The Python
models also answer their request's flags() and correlation_id(), and how many rows it held (Triton
gives execute() one request per sequence step).

Replay a seed: EDGESERVE_CONC_SEEDS=<seed> pytest tests/concurrency/test_conc_sequence.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conc_models import Repository
from conc_seq_models import SEQUENCES
from conc_server import SEEDS_ENV, endpoints, seeds, start
from es_server import RunningServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    names=st.sets(st.sampled_from([m.name for m in SEQUENCES]), min_size=1),
    max_steps=st.integers(1, 12),
    clients=st.integers(16, 64),
    p_reuse_id=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_any_mix_of_sequence_models_and_lengths(
    server: RunningServer, names: set[str], max_steps: int, clients: int, p_reuse_id: float, seed: int
) -> None:
    """Hypothesis picks the models, the longest sequence, the number of clients and how often an ID
    is started again; a failure shrinks to the smallest workload that still goes wrong."""
    models = tuple(m for m in SEQUENCES if m.name in names)
    mix = Mix(sequences=models, max_steps=max_steps, p_reuse_id=p_reuse_id, max_think_ms=1.0)
    report = run_clients(endpoints(server), seed, clients, mix, run=seed % 64, ops_per_client=4)
    assert report.ok, report.render(f"the falsifying example below; models {sorted(names)}")
