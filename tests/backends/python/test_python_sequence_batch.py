"""The sequence batcher with a real Python model instance (one worker process): a batch of several
sequences reaches execute() as one request per slot, each with its own row, control values,
correlation ID and flags; empty Direct slots below the highest used one are Triton's null requests
(READY=0, correlation ID 0); each job gets its own request's response, and one request's error fails
only that job. Queue contents are fixed by submitting before the worker starts or while a gate holds
the worker inside a call, so no timing decides what is batched."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from pymodels import write_model
from seqmodels import SEQ_SUM, SEQ_SUM_CONFIG
from tritonclient.grpc import model_config_pb2

from edgeserve.backends.base import BackendOptions, RequestInfo
from edgeserve.backends.python.backend import PythonBackend
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.sequence import SequenceBatcher
from edgeserve.scheduling.stats import ModelStats

WAIT_S = 30.0


class Recording:
    """A Python instance whose execute calls are recorded and can be held at a gate."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.io = inner.io
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.calls: list[tuple[list[dict[str, np.ndarray]], list[RequestInfo]]] = []

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> Any:
        raise AssertionError("a Python model's sequence batch must go through infer_requests")

    def infer_requests(self, batch: Sequence[Mapping[str, np.ndarray]], infos: Sequence[RequestInfo]) -> Any:
        self.calls.append(([{k: np.array(v) for k, v in r.items()} for r in batch], list(infos)))
        self.entered.release()
        assert self.gate.wait(WAIT_S)
        return self.inner.infer_requests(batch, infos)

    def close(self) -> None:
        self.inner.close()


class Answer:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None

    def __call__(self, value: Any) -> None:
        self.value = value
        self.done.set()

    def get(self) -> Any:
        assert self.done.wait(WAIT_S), "no answer"
        return self.value


@pytest.fixture
def batcher(tmp_path: Path) -> Iterator[tuple[SequenceBatcher, Recording]]:
    path = write_model(tmp_path / "repo", "seq_sum", SEQ_SUM, SEQ_SUM_CONFIG)
    config = text_format.Parse(SEQ_SUM_CONFIG, model_config_pb2.ModelConfig())
    instance = Recording(PythonBackend().load(path, config, BackendOptions()))
    made = SequenceBatcher("seq_sum", 1, config, [instance], ModelStats("seq_sum", 1))
    yield made, instance
    instance.gate.set()
    made.close()


def submit(
    batcher: SequenceBatcher, seq: int, value: float, start: bool = False, end: bool = False
) -> Answer:
    answer = Answer()
    params = {"sequence_id": seq, "sequence_start": start, "sequence_end": end, "tag": f"t{seq}"}
    inputs = {"INPUT": np.full((1, 1), value, np.float32)}
    batcher.submit(Job(inputs=inputs, batch_size=1, done=answer, parameters=params, request_id=f"r{seq}"))
    return answer


def values(answer: Answer) -> dict[str, float]:
    outputs = answer.get()
    assert isinstance(outputs, dict), outputs
    assert all(array.shape == (1, 1) for array in outputs.values())
    return {name: float(array[0, 0]) for name, array in outputs.items()}


def expect(seq: int, total: float, start: bool = False, end: bool = False) -> dict[str, float]:
    return {"SUM": total, "START_OUT": float(start), "END_OUT": float(end), "READY_OUT": 1.0,
            "CORRID_OUT": float(seq), "ID_OUT": float(seq), "FLAGS_OUT": float(start | end << 1)}  # fmt: skip


def test_a_batch_of_sequences_is_one_request_per_slot(batcher: tuple[SequenceBatcher, Recording]) -> None:
    seqs, instance = batcher
    answers = [submit(seqs, 11 + i, 10.0 * (i + 1), start=True) for i in range(4)]  # queued before start
    seqs.start()
    for i, answer in enumerate(answers):
        assert values(answer) == expect(11 + i, 10.0 * (i + 1), start=True)
    [(requests, infos)] = instance.calls  # one execute call, one request per sequence
    assert [info.correlation_id for info in infos] == [11, 12, 13, 14]
    assert [info.request_id for info in infos] == ["r11", "r12", "r13", "r14"]
    assert [dict(info.parameters)["tag"] for info in infos] == ["t11", "t12", "t13", "t14"]
    assert all(info.flags == 1 for info in infos)
    for i, request in enumerate(requests):
        assert {name: a.shape for name, a in request.items()} == {n: (1, 1) for n in request}
        assert request["CORRID"][0, 0] == 11 + i and request["INPUT"][0, 0] == 10.0 * (i + 1)
        assert request["START"].dtype == np.float32 and request["END"].dtype == np.int32
        assert request["READY"][0, 0] == 1.0 and request["CORRID"].dtype == np.uint64


def test_empty_slots_are_null_requests_and_answers_stay_with_their_slot(
    batcher: tuple[SequenceBatcher, Recording],
) -> None:
    seqs, instance = batcher
    firsts = [submit(seqs, 21 + i, 1.0, start=True) for i in range(4)]  # slots 0..3
    seqs.start()
    for answer in firsts:
        answer.get()
    instance.gate.clear()
    third = submit(seqs, 23, 5.0)  # slot 2 alone: [null, null, 23]
    assert instance.entered.acquire(timeout=WAIT_S) and instance.entered.acquire(timeout=WAIT_S)
    second, fourth = submit(seqs, 22, 7.0), submit(seqs, 24, 9.0, end=True)  # queued: [null, 22, null, 24]
    instance.gate.set()
    assert values(third) == expect(23, 6.0)
    assert values(second) == expect(22, 8.0)
    assert values(fourth) == expect(24, 10.0, end=True)
    (_, alone_infos), (pair, pair_infos) = instance.calls[1:]
    assert [info.correlation_id for info in alone_infos] == [0, 0, 23]
    assert [info.correlation_id for info in pair_infos] == [0, 22, 0, 24]
    assert [info.flags for info in pair_infos] == [0, 0, 0, 2]
    for position in (0, 2):  # null requests: READY 0, CORRID 0, zero input
        null = pair[position]
        assert null["READY"][0, 0] == 0 and null["CORRID"][0, 0] == 0 and null["INPUT"][0, 0] == 0
        assert pair_infos[position] == RequestInfo()
    assert pair[1]["CORRID"][0, 0] == 22 and pair[3]["CORRID"][0, 0] == 24


def test_one_requests_error_fails_only_its_job(batcher: tuple[SequenceBatcher, Recording]) -> None:
    seqs, _ = batcher
    answers = [submit(seqs, 31, 1.0, start=True), submit(seqs, 32, -1.0, start=True),
               submit(seqs, 33, 3.0, start=True)]  # fmt: skip
    seqs.start()
    assert values(answers[0]) == expect(31, 1.0, start=True)
    error = answers[1].get()
    assert isinstance(error, InferenceError) and error.status is Status.INTERNAL
    assert error.message == "seq_sum version 1: negative input"
    assert values(answers[2]) == expect(33, 3.0, start=True)
    assert values(submit(seqs, 32, 2.0)) == expect(32, 2.0)  # the sequence goes on
    stats = seqs.stats.to_dict()["inference_stats"]
    assert stats["fail"]["count"] == 1 and stats["success"]["count"] == 3
