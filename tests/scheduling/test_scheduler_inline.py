"""Inline runs (`Scheduler.try_run_inline`): a job runs on the caller's thread only when a worker
would run it at once anyway, its instance is never used twice at the same time, and the accounting
is the same as for a queued job. Real onnxruntime model; gates instead of sleeps."""

from __future__ import annotations

import threading

import numpy as np
from sched_helpers import WAIT_S, make_job, mlp_input

from edgeserve.scheduling.scheduler import Scheduler

BATCHING = "max_batch_size: 8\ndynamic_batching { }\n"


def delayed(window_us: int) -> str:
    return f"max_batch_size: 8\ndynamic_batching {{ max_queue_delay_microseconds: {window_us} }}\n"


GENEROUS_NS = 10_000_000_000  # any compute time qualifies


def measured(scheduler: Scheduler) -> None:
    """One queued job, so the scheduler knows the model's compute time."""
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    result.outputs()
    assert scheduler.wait_idle(WAIT_S)
    assert scheduler.compute_ewma_ns > 0


def test_runs_on_the_callers_thread_with_the_same_answer_and_stats(make_scheduler, reference):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING)
    measured(scheduler)
    job, result = make_job(mlp_input(seed=3))
    assert scheduler.try_run_inline(job, GENEROUS_NS)
    assert result.calls == 1  # finished before try_run_inline returned
    assert result.thread == threading.current_thread().name
    assert instance.threads == ["edgeserve-mlp-v1-0", threading.current_thread().name]
    expected = reference("mlp", job.inputs)["OUTPUT0"]
    np.testing.assert_allclose(result.outputs()["OUTPUT0"], expected, rtol=1e-5)
    stats = scheduler.stats.to_dict()
    assert stats["inference_count"] == 2
    assert stats["execution_count"] == 2
    assert stats["inference_stats"]["success"]["count"] == 2
    assert scheduler.wait_idle(0)


def test_declines_until_a_compute_time_is_known(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING)
    job, result = make_job(mlp_input())
    assert scheduler.compute_ewma_ns == 0
    assert not scheduler.try_run_inline(job, GENEROUS_NS)
    assert result.calls == 0 and instance.calls == []  # nothing happened: the caller submits it


def test_declines_a_model_slower_than_the_limit(make_scheduler):
    scheduler, _ = make_scheduler("mlp", BATCHING)
    measured(scheduler)
    job, result = make_job(mlp_input())
    assert not scheduler.try_run_inline(job, 1)  # 1 ns: no model is that fast
    assert result.calls == 0


def test_declines_a_batching_model_slower_than_its_batching_window(make_scheduler):
    scheduler, _ = make_scheduler("mlp", delayed(20))
    measured(scheduler)
    scheduler.compute_ewma_ns = 50_000  # scripted: a run takes longer than the 20 µs window
    job, result = make_job(mlp_input())
    assert not scheduler.try_run_inline(job, GENEROUS_NS)
    assert result.calls == 0 and scheduler.inline_runs == 0


def test_respects_a_long_batching_window(make_scheduler):
    """A window over 1 ms trades latency for batch size on purpose: the batcher waits, as in Triton."""
    scheduler, _ = make_scheduler("mlp", delayed(600_000))
    measured(scheduler)
    job, result = make_job(mlp_input())
    assert not scheduler.try_run_inline(job, GENEROUS_NS)
    assert result.calls == 0 and scheduler.inline_runs == 0


def test_runs_a_batching_model_faster_than_its_short_window(make_scheduler, reference):
    """A run shorter than a short window answers before a batch of that window would start."""
    scheduler, _ = make_scheduler("mlp", delayed(1000))
    measured(scheduler)
    scheduler.compute_ewma_ns = 50_000  # scripted: runs take 50 µs (a clock is never asserted on)
    job, result = make_job(mlp_input(seed=5))
    assert scheduler.try_run_inline(job, GENEROUS_NS)
    assert result.calls == 1 and scheduler.inline_runs == 1
    np.testing.assert_allclose(
        result.outputs()["OUTPUT0"], reference("mlp", job.inputs)["OUTPUT0"], rtol=1e-5
    )


def test_declines_while_the_only_instance_is_busy_or_jobs_wait(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING)
    measured(scheduler)
    instance.gate.clear()
    busy, busy_result = make_job(mlp_input())
    scheduler.submit(busy)
    instance.wait_entered(2)  # the measuring call and this one
    queued, queued_result = make_job(mlp_input())
    scheduler.submit(queued)
    assert scheduler.pending_count == 1
    job, result = make_job(mlp_input())
    assert not scheduler.try_run_inline(job, GENEROUS_NS)  # running instance, and a queue
    instance.gate.set()
    busy_result.outputs()
    queued_result.outputs()
    assert result.calls == 0
    assert scheduler.wait_idle(WAIT_S)


def test_a_claimed_instance_is_never_used_by_its_worker_meanwhile(make_scheduler, reference):
    """One instance: while an inline job holds it, a job submitted from elsewhere waits in the queue
    and runs once the inline run ends, on the worker."""
    scheduler, (instance,) = make_scheduler("mlp", BATCHING)
    measured(scheduler)
    instance.gate.clear()
    inline_job, inline_result = make_job(mlp_input(seed=1))
    ran: list[bool] = []
    caller = threading.Thread(
        target=lambda: ran.append(scheduler.try_run_inline(inline_job, GENEROUS_NS)), name="frontend"
    )
    caller.start()
    instance.wait_entered(2)  # the inline job is inside infer(), on the "frontend" thread
    other, other_result = make_job(mlp_input(seed=2))
    scheduler.submit(other)
    assert scheduler.pending_count == 1  # the worker did not take it: its instance is claimed
    instance.gate.set()
    caller.join(WAIT_S)
    assert ran == [True]
    np.testing.assert_allclose(other_result.outputs()["OUTPUT0"], reference("mlp", other.inputs)["OUTPUT0"],
                               rtol=1e-5)  # fmt: skip
    assert inline_result.thread == "frontend"
    assert other_result.thread == "edgeserve-mlp-v1-0"
    assert instance.max_active == 1
    assert scheduler.wait_idle(WAIT_S)


def test_with_two_instances_the_free_one_serves_the_queue_during_an_inline_run(make_scheduler):
    scheduler, instances = make_scheduler("mlp", BATCHING, instances=2)
    measured(scheduler)
    next(i for i in instances if i.calls).wait_entered()  # the measuring call's signal
    for instance in instances:
        instance.gate.clear()
    inline_job, inline_result = make_job(mlp_input())
    caller = threading.Thread(target=scheduler.try_run_inline, args=(inline_job, GENEROUS_NS))
    caller.start()
    claimed, free = instances  # both idle: the inline run claims the first
    claimed.wait_entered()
    other, other_result = make_job(mlp_input())
    scheduler.submit(other)
    free.wait_entered()  # the other worker took it while the inline run still holds its instance
    assert scheduler.pending_count == 0
    for instance in instances:
        instance.gate.set()
    caller.join(WAIT_S)
    inline_result.outputs()
    other_result.outputs()
    assert other_result.thread == "edgeserve-mlp-v1-1"
    assert all(i.max_active == 1 for i in instances)
    assert scheduler.wait_idle(WAIT_S)


def test_declines_once_draining_and_close_waits_for_an_inline_run(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING)
    measured(scheduler)
    instance.gate.clear()
    job, result = make_job(mlp_input())
    caller = threading.Thread(target=scheduler.try_run_inline, args=(job, GENEROUS_NS))
    caller.start()
    instance.wait_entered(2)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for the inline run to give the instance back
    assert not instance.closed
    instance.gate.set()
    closer.join(WAIT_S)
    caller.join(WAIT_S)
    assert instance.closed
    result.outputs()
    late, late_result = make_job(mlp_input())
    assert not scheduler.try_run_inline(late, GENEROUS_NS)
    assert late_result.calls == 0
