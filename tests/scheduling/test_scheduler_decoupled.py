"""Decoupled models in the scheduler (scheduling/decoupled.py): 0..N responses per job in order, the
job finished at its final flag (not when execute returns), dynamic batching, statistics, a cancel or
a deadline ending a live stream (the model sees `cancelled`, later sends are dropped), sends after
the final flag refused.

`RepeatInstance` is an in-test StreamingInstance (backends/streams.py); it stands in for the Python
backend's decoupled models (H1's issue-35 work) at this level, where no worker process is needed."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from sched_helpers import WAIT_S, make_config

from edgeserve.backends.base import ModelIO, RequestInfo, TensorSpec
from edgeserve.backends.streams import ResponseSink, StreamingInstance
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.queue import TIMEOUT_MESSAGE
from edgeserve.scheduling.scheduler import Scheduler
from edgeserve.scheduling.stats import ModelStats

DECOUPLED = 'name: "repeat"\nmax_batch_size: 8\nmodel_transaction_policy { decoupled: true }\n'


class RepeatInstance:
    """Triton's "repeat" pattern: one response per element of IN (each row of the job), then the final
    flag, sent from a thread of the model's own after execute returned. `hold` keeps that thread
    before its final flag (a never-final model) until released."""

    io = ModelIO((TensorSpec("IN", "INT32", (-1, -1)),), (TensorSpec("OUT", "INT32", (-1, 1)),))

    def __init__(self) -> None:
        self.batches: list[int] = []  # jobs per execute call
        self.hold = threading.Event()
        self.hold.set()
        self.saw_cancelled = threading.Event()
        self.after_final_errors: list[InferenceError] = []
        self.returned = threading.Event()  # execute returned (before any response was sent)
        self.send_after_final = False
        self.finished_sending = threading.Event()

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, Any]:
        raise AssertionError("a decoupled model is never run through infer()")

    def infer_decoupled(
        self,
        batch: Sequence[Mapping[str, np.ndarray]],
        infos: Sequence[RequestInfo],
        sinks: Sequence[ResponseSink],
    ) -> None:
        self.batches.append(len(batch))
        values = [np.asarray(inputs["IN"]).reshape(-1) for inputs in batch]
        threading.Thread(target=self._respond, args=(values, list(sinks)), daemon=True).start()
        self.returned.set()

    def _respond(self, values: list[np.ndarray], sinks: list[ResponseSink]) -> None:
        for row, sink in zip(values, sinks, strict=True):
            for value in row:
                sink.send({"OUT": np.array([[value]], dtype=np.int32)})
        self.hold.wait(WAIT_S)
        for sink in sinks:
            if sink.cancelled:
                self.saw_cancelled.set()
            sink.send(None, final=True)
            if self.send_after_final:
                try:
                    sink.send({"OUT": np.zeros((1, 1), np.int32)})
                except InferenceError as exc:
                    self.after_final_errors.append(exc)
        self.finished_sending.set()

    def close(self) -> None:
        pass


class Responses:
    """A job's responses as `on_response` got them; `ended` when the final came."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, bool]] = []
        self.ended = threading.Event()

    def __call__(self, result: Any, final: bool) -> None:
        self.items.append((result, final))
        if final:
            self.ended.set()

    def values(self) -> list[int]:
        return [int(r["OUT"][0, 0]) for r, _ in self.items if isinstance(r, dict)]


def _job(values: list[int], timeout_us: int = 0) -> tuple[Job, Responses]:
    responses = Responses()
    inputs = {"IN": np.array([values], dtype=np.int32)}
    job = Job(inputs=inputs, batch_size=1, done=lambda r: responses(r, True), on_response=responses,
              timeout_us=timeout_us)  # fmt: skip
    return job, responses


@pytest.fixture
def scheduler() -> Any:
    made: list[Scheduler] = []

    def make(
        text: str = DECOUPLED, instance: RepeatInstance | None = None
    ) -> tuple[Scheduler, RepeatInstance]:
        instance = instance or RepeatInstance()
        sched = Scheduler("repeat", 1, make_config(text), [instance], ModelStats("repeat", 1))
        sched.start()
        made.append(sched)
        return sched, instance

    yield make
    for sched in made:
        sched.close()


def test_the_stand_in_is_a_streaming_instance() -> None:
    assert isinstance(RepeatInstance(), StreamingInstance)


def test_responses_arrive_in_order_and_the_job_ends_at_the_final_flag(scheduler: Any) -> None:
    sched, instance = scheduler()
    instance.hold.clear()
    job, responses = _job([4, 5, 6])
    sched.submit(job)
    assert instance.returned.wait(WAIT_S)
    # execute returned, the final flag has not come: the job is live, the instance is free
    assert sched.wait_idle(WAIT_S) and sched.live_streams == 1 and not job.finished
    instance.hold.set()
    assert responses.ended.wait(WAIT_S)
    assert responses.values() == [4, 5, 6]
    assert responses.items[-1] == (None, True)  # the final flag alone
    assert sched.live_streams == 0 and job.finished
    stats = sched.stats.to_dict()
    assert stats["inference_stats"]["success"]["count"] == 1 and stats["execution_count"] == 1
    assert [stats["response_stats"][k]["success"]["count"] for k in ("0", "1", "2")] == [1, 1, 1]


def test_dynamic_batching_still_applies(scheduler: Any) -> None:
    window = "dynamic_batching { max_queue_delay_microseconds: 20000000 preferred_batch_size: [3] }\n"
    text = DECOUPLED + window
    sched, instance = scheduler(text)
    jobs = [_job([i]) for i in range(3)]
    for job, _ in jobs:
        sched.submit(job)
    for _, responses in jobs:
        assert responses.ended.wait(WAIT_S)
    assert instance.batches == [3]  # the preferred size formed one batch long before the 20 s window
    assert [responses.values() for _, responses in jobs] == [[0], [1], [2]]


def test_cancel_ends_a_live_stream_and_the_model_sees_it(scheduler: Any) -> None:
    sched, instance = scheduler()
    instance.hold.clear()
    job, responses = _job([1, 2])
    sched.submit(job)
    assert instance.returned.wait(WAIT_S)
    sched.cancel([job])
    assert responses.ended.wait(WAIT_S)
    error, final = responses.items[-1]
    assert final and isinstance(error, InferenceError) and error.status is Status.CANCELLED
    assert sched.live_streams == 0
    instance.hold.set()
    assert instance.saw_cancelled.wait(WAIT_S)
    count = len(responses.items)
    assert sched.wait_idle(WAIT_S)
    assert len(responses.items) == count  # its final flag after the cancel reached nobody


def test_a_deadline_ends_a_never_final_stream(scheduler: Any) -> None:
    sched, instance = scheduler()
    instance.hold.clear()  # never sends its final flag while held
    job, responses = _job([7], timeout_us=200_000)
    sched.submit(job)
    assert responses.ended.wait(WAIT_S)  # the watchdog ends it (200 ms deadline, waited on an event)
    error, final = responses.items[-1]
    assert final and isinstance(error, InferenceError) and error.message == TIMEOUT_MESSAGE
    assert sched.live_streams == 0
    instance.hold.set()
    assert instance.saw_cancelled.wait(WAIT_S)


def test_a_send_after_the_final_flag_is_refused(scheduler: Any) -> None:
    sched, instance = scheduler()
    instance.send_after_final = True
    job, responses = _job([3])
    sched.submit(job)
    assert responses.ended.wait(WAIT_S)
    assert instance.finished_sending.wait(WAIT_S)
    assert instance.after_final_errors and "after the final flag" in instance.after_final_errors[0].message
    assert responses.values() == [3]


def test_an_execute_that_raises_ends_every_job_with_the_error(scheduler: Any) -> None:
    class Broken(RepeatInstance):
        def infer_decoupled(self, batch: Any, infos: Any, sinks: Any) -> None:
            raise RuntimeError("model exploded")

    sched, _ = scheduler(instance=Broken())
    job, responses = _job([1])
    sched.submit(job)
    assert responses.ended.wait(WAIT_S)
    error, final = responses.items[-1]
    assert final and isinstance(error, InferenceError) and "model exploded" in error.message
    assert sched.stats.to_dict()["inference_stats"]["fail"]["count"] == 1
