"""Cancelling queued jobs (an ensemble whose other step failed): a cancelled job still queued is
answered CANCELLED once and never reaches the model, whether `cancel` finds it queued or a worker
finds the flag when it forms a batch; a job already running is not touched. A real onnxruntime
model behind a gate fixes what is queued."""

from __future__ import annotations

from typing import Any

from sched_helpers import WAIT_S, hold_worker, make_job, mlp_input, submit_all

from edgeserve.protocol.errors import InferenceError, Status

BATCHING_8 = "max_batch_size: 8\ndynamic_batching { }\n"


def _fills(instance: Any) -> list[float]:
    return [float(row[0]) for call in instance.calls for row in call["INPUT0"]]


def test_cancel_takes_queued_jobs_out_and_leaves_the_running_one(make_scheduler: Any) -> None:
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    running, running_result = hold_worker(scheduler, instance, mlp_input(fill=-1.0))
    jobs = submit_all(scheduler, [mlp_input(fill=float(i)) for i in range(3)])
    assert scheduler.pending_count == 3
    scheduler.cancel([running, jobs[0][0], jobs[2][0]])
    assert scheduler.pending_count == 1
    for index in (0, 2):
        error = jobs[index][1].error()
        assert isinstance(error, InferenceError) and error.status is Status.CANCELLED
        assert error.message == "mlp version 1: cancelled before it ran (its request ended)"
    instance.gate.set()
    running_result.outputs()  # already running: it finishes
    jobs[1][1].outputs()
    assert scheduler.wait_idle(WAIT_S)
    assert _fills(instance) == [-1.0, 1.0]  # the cancelled ones never reached the model
    assert all(result.calls == 1 for _, result in jobs) and running_result.calls == 1
    stats = scheduler.stats.to_dict()["inference_stats"]
    assert stats["success"]["count"] == 2 and stats["fail"]["count"] == 2


def test_a_job_flagged_cancelled_is_dropped_when_a_batch_forms(make_scheduler: Any) -> None:
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    holder, _ = make_job(mlp_input(fill=-1.0))
    scheduler.submit(holder)
    instance.wait_entered()
    flagged, flagged_result = make_job(mlp_input(fill=5.0))
    kept, kept_result = make_job(mlp_input(fill=6.0))
    scheduler.submit(flagged)
    scheduler.submit(kept)
    flagged.cancelled = True  # set by its owner between submit and a cancel call
    instance.gate.set()
    kept_result.outputs()
    error = flagged_result.error()
    assert isinstance(error, InferenceError) and error.status is Status.CANCELLED
    assert scheduler.wait_idle(WAIT_S)
    assert _fills(instance) == [-1.0, 6.0]
