"""Fault injection at the scheduler: deliberately faulty instances (raise, wrong shapes, hang) around
the real ONNX Runtime backend; a request timeout while a batch runs; fair shares of a full queue;
the wait-based soft cap. Every request is answered exactly once and no worker is left wedged."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from sched_helpers import WAIT_S, GatedInstance, hold_worker, make_job, mlp_input, submit_all

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job, client_scope
from edgeserve.scheduling.queue import QUEUE_FULL_MESSAGE, JobQueue, QueuePolicy

BATCHING = "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 0 }\n"


class Faulty:
    """A real instance with one fault switched on: `mode` raise | shape | hang."""

    def __init__(self, inner: Any, mode: str) -> None:
        self.inner = inner
        self.io = inner.io
        self.mode = mode
        self.release = threading.Event()
        self.entered = threading.Event()
        self.closed = False

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, Any]:
        self.entered.set()
        if self.mode == "raise":
            raise RuntimeError("injected backend failure")
        result: dict[str, Any] = self.inner.infer(inputs, outputs)
        if self.mode == "shape":
            return {name: array[:1] for name, array in result.items()}  # drops rows of a batch
        if self.mode == "hang":
            self.release.wait(WAIT_S)
        return result

    def close(self) -> None:
        self.closed = True


def test_backend_that_raises_answers_internal_and_keeps_serving(make_scheduler: Any) -> None:
    scheduler, gated = make_scheduler("mlp", BATCHING)
    gated[0].fail_on_call[1] = RuntimeError("injected backend failure")
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    error = result.error()
    assert isinstance(error, InferenceError) and error.status is Status.INTERNAL
    assert "injected backend failure" in error.message
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S)


def test_batch_with_too_few_rows_is_internal(make_scheduler: Any) -> None:
    scheduler, gated = make_scheduler("mlp", BATCHING, open_gate=False)
    _, blocker_result = hold_worker(scheduler, gated[0], mlp_input(seed=1))
    jobs = submit_all(scheduler, [mlp_input(seed=i) for i in (2, 3)])
    inner = gated[0].inner
    gated[0].inner = Faulty(inner, "shape")
    gated[0].gate.set()
    assert isinstance(blocker_result.get(), dict) or blocker_result.calls == 1
    for _, result in jobs:
        error = result.error()
        assert isinstance(error, InferenceError) and error.status is Status.INTERNAL
        assert "expected 2 rows" in error.message
    gated[0].inner = inner
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)


def test_hung_instance_is_answered_and_replaced(make_scheduler: Any) -> None:
    replacements: list[GatedInstance] = []
    made: dict[str, Any] = {}

    def factory() -> Any:
        fresh = GatedInstance(made["real"])
        replacements.append(fresh)
        return fresh

    # The watchdog's clock is injected: its thread never reaches the hour; the test calls its check
    # with a `now` of its own.
    scheduler, gated = make_scheduler("mlp", BATCHING, hang_timeout_s=3600.0, instance_factory=factory)
    made["real"] = gated[0].inner
    hung = Faulty(gated[0].inner, "hang")
    # the worker thread holds its instance object: swap what it calls through the gated wrapper
    gated[0].inner = hung
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    gated[0].wait_entered()
    started = time.monotonic_ns()
    scheduler.check_running(started + int(1800e9))  # not yet: nothing is answered
    assert result.calls == 0 and scheduler.replaced == 0
    scheduler.check_running(started + int(3601e9))  # past the hang timeout (whenever the batch began)
    error = result.error()
    assert isinstance(error, InferenceError) and error.status is Status.UNAVAILABLE
    assert "did not answer in 3600 s" in error.message
    deadline = time.monotonic() + WAIT_S
    while scheduler.replaced == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.replaced == 1 and len(replacements) == 1
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert replacements[0].calls, "the replacement instance served the next request"
    hung.release.set()  # the hung call returns at last: its result is dropped, its instance closed
    deadline = time.monotonic() + WAIT_S
    while not gated[0].closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gated[0].closed
    assert result.calls == 1
    assert scheduler.wait_idle(WAIT_S)


def test_request_timeout_answers_while_the_batch_runs(make_scheduler: Any) -> None:
    # No hang timeout: no watchdog thread; the test calls its check with the clock it wants.
    scheduler, gated = make_scheduler("mlp", BATCHING, open_gate=False, hang_timeout_s=0)
    job, result = make_job(mlp_input(), timeout_us=100_000_000)
    scheduler.submit(job)
    gated[0].wait_entered()
    scheduler.check_running(job.deadline_ns - 1)
    assert result.calls == 0
    scheduler.check_running(job.deadline_ns)  # the deadline passes while the batch runs
    error = result.error()
    assert isinstance(error, InferenceError) and "timeout" in error.message.lower()
    gated[0].gate.set()  # the batch finishes later: no second answer
    assert scheduler.wait_idle(WAIT_S)
    assert result.calls == 1


# -- overload --------------------------------------------------------------------------------------
def _job(client: str) -> tuple[Job, list[Any]]:
    got: list[Any] = []
    return Job(inputs={}, batch_size=1, done=got.append, client=client), got


def test_full_queue_is_shared_fairly_between_clients() -> None:
    queue = JobQueue([QueuePolicy(max_queue_size=4)], priorities=False)
    flood = [_job("camera-a")[0] for _ in range(4)]
    for job in flood:
        assert queue.push(job, 1, 0) is None
    with pytest.raises(InferenceError, match=QUEUE_FULL_MESSAGE):
        queue.push(_job("camera-a")[0], 1, 0)  # the flooding client is refused
    other, _ = _job("camera-b")
    evicted = queue.push(other, 1, 0)  # a quieter client takes the flooder's newest slot
    assert evicted is flood[-1] and len(queue) == 4
    third, _ = _job("camera-c")
    assert queue.push(third, 1, 0) is flood[-2]
    with pytest.raises(InferenceError):
        queue.push(_job("camera-b")[0], 1, 0)  # b holds 1, a holds 2: not 2 more than b
    queue.remove([flood[0]])
    assert queue.push(_job("camera-b")[0], 1, 0) is None
    assert len(queue) == 4 and len(queue.pop_all()) == 4


def test_refusal_hint_agrees_with_push() -> None:
    # would_refuse lets a frontend refuse before decoding; it must never refuse what push would take
    queue = JobQueue([QueuePolicy(max_queue_size=3)], priorities=False)
    assert not queue.would_refuse("camera-a")
    for _ in range(3):
        queue.push(_job("camera-a")[0], 1, 0)
    assert queue.would_refuse("camera-a")  # full, and a is the only client
    assert not queue.would_refuse("camera-b")  # b would take a's newest place
    queue.push(_job("camera-b")[0], 1, 0)
    assert queue.would_refuse("camera-b")  # a 2, b 1: no longer 2 more than b
    with pytest.raises(InferenceError):
        queue.push(_job("camera-b")[0], 1, 0)
    unsized = JobQueue([QueuePolicy()], priorities=False)  # no max_queue_size: the soft cap bounds it
    for _ in range(2):
        unsized.push(_job("camera-a")[0], 1, 0)
    assert not unsized.would_refuse("camera-a", soft_cap=8)
    assert unsized.would_refuse("camera-a", soft_cap=2)
    levels = JobQueue([QueuePolicy(max_queue_size=1)] * 2, priorities=True)
    levels.push(_job("camera-a")[0], 1, 0)
    assert not levels.would_refuse("camera-a")  # the level depends on the request: push decides


def test_scheduler_refuses_a_full_queue_before_decoding(make_scheduler: Any) -> None:
    scheduler, gated = make_scheduler("mlp", BATCHING, open_gate=False, max_queue_wait_s=0.5)
    scheduler._soft_cap = 4
    with client_scope("camera-a"):
        assert not scheduler.refuses("camera-a")
        # the only worker holds one job first: while the queue fills nothing drains it, so the hint
        # and the submit after it see the same full queue
        held = [hold_worker(scheduler, gated[0], mlp_input())[1]]
        while not scheduler.refuses("camera-a"):
            job, result = make_job(mlp_input())
            scheduler.submit(job)
            held.append(result)
        assert len(held) <= 4 + 1  # the queue's cap, plus the job the worker holds
        with pytest.raises(InferenceError, match=QUEUE_FULL_MESSAGE):
            scheduler.submit(make_job(mlp_input())[0])
    assert not scheduler.refuses("camera-b")
    assert scheduler.stats.snapshot().fail_by_reason["REJECTED"] == 2  # the hint and the submit
    gated[0].gate.set()
    for result in held:
        result.outputs()
    assert scheduler.wait_idle(WAIT_S) and not scheduler.refuses("camera-a")


def test_soft_cap_bounds_the_wait_and_explicit_size_wins(make_scheduler: Any) -> None:
    scheduler, _ = make_scheduler("mlp", BATCHING, max_queue_wait_s=0.5)
    for _ in range(20):
        job, result = make_job(mlp_input())
        scheduler.submit(job)
        result.get()
    cost = scheduler.job_cost_ewma_ns
    assert cost > 0
    assert scheduler.soft_queue_cap == max(2 * 8, int(0.5e9) // cost)
    policy = QueuePolicy.from_proto(type("P", (), {"max_queue_size": 5, "timeout_action": 0,
                                                   "default_timeout_microseconds": 0,
                                                   "allow_timeout_override": False})())  # fmt: skip
    assert policy.explicit_size and policy.max_queue_size == 5


def test_overload_rejects_at_once_and_recovers(make_scheduler: Any) -> None:
    scheduler, gated = make_scheduler("mlp", BATCHING, open_gate=False, max_queue_wait_s=0.5)
    scheduler._soft_cap = 16  # as measured for a slow model
    results = []
    rejected = 0
    with client_scope("camera-a"):
        for i in range(100):
            job, result = make_job(mlp_input(seed=i))
            try:
                # never a wait: the only batch that could make room is held at the gate, so a
                # submit that waited would never return
                scheduler.submit(job)
                results.append(result)
            except InferenceError as exc:
                assert exc.status is Status.UNAVAILABLE
                rejected += 1
    assert scheduler.pending_count <= 16 and rejected >= 100 - 16 - 8  # one batch of 8 may be running
    gated[0].gate.set()
    for result in results:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S) and scheduler.pending_count == 0
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)
