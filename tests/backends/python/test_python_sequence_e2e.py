"""A Python sequence model (running sum per CORRID, START fp32 / END int32 / READY fp32 / CORRID uint64,
max_batch_size 8, Direct and Oldest) behind a real `edgeserve serve`: several clients, each running
its own sequence at the same moment over gRPC and HTTP (tritonclient), each get their own sums and
their own control values back, never another sequence's or a padding slot's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server
from pymodels import write_model
from seqmodels import SEQ_SUM, SEQ_SUM_CONFIG, SEQ_SUM_OLDEST_CONFIG
from sequence_steps import run_clients, send_step

pytestmark = pytest.mark.timeout(300)

CLIENTS = 4
STEPS = 4
SLOW_SUM = SEQ_SUM.replace("        responses = []\n", "        import time\n        time.sleep(0.02)\n"
                           "        responses = []\n", 1)  # fmt: skip
OUTPUTS = ("SUM", "START_OUT", "END_OUT", "READY_OUT", "CORRID_OUT", "ID_OUT", "FLAGS_OUT")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("pyseq")
    repo = tmp / "repo"
    # A short pause in execute() lets the clients' next steps queue behind a running batch, so most
    # batches hold several sequences (the case that went wrong); answers never depend on it.
    write_model(repo, "seq_sum", SLOW_SUM, SEQ_SUM_CONFIG)
    write_model(repo, "seq_sum_oldest", SLOW_SUM, SEQ_SUM_OLDEST_CONFIG)
    running = start_server(repo, tmp)
    yield running
    running.stop()


Step = Callable[[int, float, bool, bool], dict[str, float]]
# Called on the client's own thread (tritonclient.http's connections belong to the thread that made
# them): the step function and what closes its client.
Client = Callable[[int], tuple[Step, Callable[[], None]]]


def _expected(seq: int, step: int, total: float) -> dict[str, float]:
    start, end = step == 0, step == STEPS - 1
    return {"SUM": total, "START_OUT": float(start), "END_OUT": float(end), "READY_OUT": 1.0,
            "CORRID_OUT": float(seq), "ID_OUT": float(seq), "FLAGS_OUT": float(start | end << 1)}  # fmt: skip


def _run_together(client: Client, first_id: int) -> list[str]:
    """CLIENTS threads, each its own sequence, every step released for all of them at once."""
    barrier = threading.Barrier(CLIENTS)
    errors: list[str] = []

    def run(index: int) -> None:
        seq = first_id + index
        total = 0.0
        step, close = client(index)
        try:
            for n in range(STEPS):
                value = float(index * 100 + n + 1)
                total += value
                try:
                    barrier.wait(60)
                    got = step(seq, value, n == 0, n == STEPS - 1)
                except Exception as exc:
                    errors.append(f"client {index} step {n}: {exc}")
                    barrier.abort()
                    return
                if got != _expected(seq, n, total):
                    errors.append(f"client {index} (sequence {seq}) step {n}: got {got}")
        finally:
            close()

    run_clients(run, CLIENTS)
    return errors


def _values(result: Any) -> dict[str, float]:
    return {name: float(result.as_numpy(name)[0, 0]) for name in OUTPUTS}


def _over(module: Any, url: str, model: str) -> Client:
    def make(index: int) -> tuple[Step, Callable[[], None]]:
        client = module.InferenceServerClient(url)

        def step(seq: int, value: float, start: bool, end: bool) -> dict[str, float]:
            return _values(send_step(client, model, seq, value, start, end))

        return step, client.close

    return make


def _grpc(server: RunningServer, model: str) -> Client:
    return _over(grpcclient, server.grpc_url, model)


def _http(server: RunningServer, model: str) -> Client:
    return _over(httpclient, server.http_url, model)


@pytest.mark.parametrize("model", ["seq_sum", "seq_sum_oldest"])
def test_concurrent_grpc_sequences_get_their_own_answers(server: RunningServer, model: str) -> None:
    for round_ in range(3):
        assert _run_together(_grpc(server, model), 1000 + 10 * round_) == []


@pytest.mark.parametrize("model", ["seq_sum", "seq_sum_oldest"])
def test_concurrent_http_sequences_get_their_own_answers(server: RunningServer, model: str) -> None:
    for round_ in range(3):
        assert _run_together(_http(server, model), 2000 + 10 * round_) == []


def test_grpc_and_http_sequences_mixed(server: RunningServer) -> None:
    by_grpc, by_http = _grpc(server, "seq_sum"), _http(server, "seq_sum")
    assert _run_together(lambda i: (by_grpc if i % 2 else by_http)(i), 3000) == []
