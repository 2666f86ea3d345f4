"""Priorities, queue policy (size caps, timeouts with REJECT and DELAY, overrides), backend errors and
the scheduler lifecycle (drain, close), with a real onnxruntime model behind a gate."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sched_helpers import WAIT_S, make_job, mlp_input

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.queue import QueuePolicy
from edgeserve.scheduling.stats import batch_sizes


def _status(error: BaseException) -> Status:
    assert isinstance(error, InferenceError), repr(error)
    return error.status


def _fills(instance, skip: int = 1) -> list[float]:
    """The fill value of each call's input, in execution order (jobs made with mlp_input(fill=...))."""
    return [float(call["INPUT0"][0, 0]) for call in instance.calls[skip:]]


def _hold_worker(scheduler, instance):
    """Submit a job and wait until the worker is inside infer() with it; returns its Result."""
    job, result = make_job(mlp_input(fill=-1.0))
    scheduler.submit(job)
    instance.wait_entered()
    return result


BATCHING_8 = "max_batch_size: 8\ndynamic_batching { }\n"
PRIORITY_CONFIG = """
max_batch_size: 1
dynamic_batching { priority_levels: 3 default_priority_level: 2 }
"""


def test_higher_priority_jobs_run_first(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", PRIORITY_CONFIG, open_gate=False)
    _hold_worker(scheduler, instance)
    results = []
    for fill, priority in ((1, 3), (2, 0), (3, 1), (4, 2), (5, 1)):
        job, result = make_job(mlp_input(fill=float(fill)), priority=priority)
        scheduler.submit(job)
        results.append(result)
    instance.gate.set()
    for result in results:
        result.outputs()
    assert scheduler.wait_idle(WAIT_S)
    # level 1 (3, 5), then level 2 = default (2, 4), then level 3 (1); FIFO inside a level
    assert _fills(instance) == [3.0, 5.0, 2.0, 4.0, 1.0]


def test_priority_out_of_range_is_invalid_arg(make_scheduler):
    scheduler, _ = make_scheduler("mlp", PRIORITY_CONFIG)
    job, result = make_job(mlp_input(), priority=4)
    with pytest.raises(InferenceError) as info:
        scheduler.submit(job)
    assert info.value.status is Status.INVALID_ARG
    assert result.calls == 0  # the caller reports a raised error itself
    assert scheduler.stats.to_dict()["inference_stats"]["fail"]["count"] == 1


def test_priority_is_ignored_without_priority_levels(make_scheduler):
    scheduler, _ = make_scheduler("mlp", "max_batch_size: 8\ndynamic_batching { }\n")
    job, result = make_job(mlp_input(), priority=7)
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)


def test_max_queue_size_rejects_with_unavailable(make_scheduler):
    config = "max_batch_size: 8\ndynamic_batching { default_queue_policy { max_queue_size: 2 } }\n"
    scheduler, (instance,) = make_scheduler("mlp", config, open_gate=False)
    _hold_worker(scheduler, instance)  # executing, so not counted in the queue
    accepted = [make_job(mlp_input(seed=i)) for i in range(2)]
    for job, _ in accepted:
        scheduler.submit(job)
    overflow, overflow_result = make_job(mlp_input())
    with pytest.raises(InferenceError) as info:
        scheduler.submit(overflow)
    assert info.value.status is Status.UNAVAILABLE
    assert info.value.message == "Exceeds maximum queue size"
    assert overflow_result.calls == 0
    instance.gate.set()
    for _, result in accepted:
        result.outputs()
    assert scheduler.wait_idle(WAIT_S)
    stats = scheduler.stats
    assert stats.to_dict()["inference_stats"]["fail"]["count"] == 1
    assert stats.snapshot().fail_by_reason["REJECTED"] == 1


def test_queue_size_is_per_priority_level(make_scheduler):
    config = """
max_batch_size: 1
dynamic_batching {
  priority_levels: 2 default_priority_level: 2
  priority_queue_policy { key: 1 value { max_queue_size: 1 } }
}
"""
    scheduler, (instance,) = make_scheduler("mlp", config, open_gate=False)
    _hold_worker(scheduler, instance)
    scheduler.submit(make_job(mlp_input(), priority=1)[0])
    with pytest.raises(InferenceError, match="Exceeds maximum queue size"):
        scheduler.submit(make_job(mlp_input(), priority=1)[0])
    for _ in range(3):  # level 2 has no limit of its own
        scheduler.submit(make_job(mlp_input(), priority=2)[0])
    assert scheduler.pending_count == 4


def test_hard_cap_applies_when_max_queue_size_is_unlimited(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", "max_batch_size: 8\n", open_gate=False, hard_queue_cap=3)
    _hold_worker(scheduler, instance)
    for _ in range(3):
        scheduler.submit(make_job(mlp_input())[0])
    with pytest.raises(InferenceError, match="Exceeds maximum queue size") as info:
        scheduler.submit(make_job(mlp_input())[0])
    assert info.value.status is Status.UNAVAILABLE


def test_timeout_reject_fails_promptly_while_a_batch_waits(make_scheduler):
    # The worker waits up to 60 s for a batch of 4; the job's 20 ms timeout must not wait for that.
    config = """
max_batch_size: 8
dynamic_batching {
  preferred_batch_size: [4] max_queue_delay_microseconds: 60000000
  default_queue_policy { default_timeout_microseconds: 20000 }
}
"""
    scheduler, (instance,) = make_scheduler("mlp", config)
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    error = result.error()
    assert _status(error) is Status.UNAVAILABLE
    assert error.message == "Request timeout expired"
    assert instance.calls == []
    assert scheduler.wait_idle(WAIT_S)
    snap = scheduler.stats.snapshot()
    assert (snap.success.count, snap.fail.count, snap.fail_by_reason["REJECTED"]) == (0, 1, 1)


def test_timeout_reject_behind_a_busy_worker(make_scheduler):
    config = """
max_batch_size: 1
dynamic_batching { default_queue_policy { default_timeout_microseconds: 1000000 } }
"""
    scheduler, (instance,) = make_scheduler("mlp", config, open_gate=False)
    _hold_worker(scheduler, instance)
    stale, stale_result = make_job(mlp_input(fill=1.0), age_s=10.0)  # its 1 s timeout is long gone
    fresh, fresh_result = make_job(mlp_input(fill=2.0))
    scheduler.submit(stale)
    scheduler.submit(fresh)
    instance.gate.set()
    assert _status(stale_result.error()) is Status.UNAVAILABLE
    assert fresh_result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S)
    assert _fills(instance) == [2.0]


def test_timeout_delay_moves_expired_jobs_behind_live_ones(make_scheduler):
    config = """
max_batch_size: 1
dynamic_batching {
  default_queue_policy {
    timeout_action: DELAY default_timeout_microseconds: 1000000 allow_timeout_override: true
  }
}
"""
    scheduler, (instance,) = make_scheduler("mlp", config, open_gate=False)
    _hold_worker(scheduler, instance)
    results = []
    for fill, age_s in ((1.0, 10.0), (2.0, 0.0), (3.0, 0.0)):
        job, result = make_job(mlp_input(fill=fill), age_s=age_s, timeout_us=60_000_000 if age_s == 0 else 0)
        scheduler.submit(job)
        results.append(result)
    instance.gate.set()
    for result in results:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)  # DELAY: late, but it still runs
    assert scheduler.wait_idle(WAIT_S)
    assert _fills(instance) == [2.0, 3.0, 1.0]


@pytest.mark.parametrize(
    ("allow_override", "default_us", "request_us", "rejected"),
    [
        (False, 60_000_000, 1, False),  # the 60 s default holds: the request may not shorten it
        (True, 60_000_000, 1, True),  # override allowed: the request's 1 µs applies
        (False, 0, 1, True),  # no default: the request's own timeout applies
        (True, 1, 60_000_000, False),  # override allowed: the request extends a 1 µs default
        (False, 0, 0, False),  # no timeout anywhere
    ],
)
def test_request_timeout_override(make_scheduler, allow_override, default_us, request_us, rejected):
    flag = "true" if allow_override else "false"
    policy = f"default_timeout_microseconds: {default_us} allow_timeout_override: {flag}"
    config = f"max_batch_size: 8\ndynamic_batching {{ default_queue_policy {{ {policy} }} }}\n"
    scheduler, _ = make_scheduler("mlp", config)
    job, result = make_job(mlp_input(), timeout_us=request_us, age_s=10.0)
    scheduler.submit(job)
    if rejected:
        assert _status(result.error()) is Status.UNAVAILABLE
    else:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)


def test_effective_timeout_rules():
    assert QueuePolicy(default_timeout_us=5, allow_timeout_override=False).effective_timeout_us(9) == 5
    assert QueuePolicy(default_timeout_us=5, allow_timeout_override=True).effective_timeout_us(9) == 9
    assert QueuePolicy(default_timeout_us=5, allow_timeout_override=True).effective_timeout_us(0) == 5
    assert QueuePolicy(default_timeout_us=0).effective_timeout_us(9) == 9


def test_request_timeout_applies_without_dynamic_batching(make_scheduler):
    scheduler, _ = make_scheduler("mlp", "max_batch_size: 8\n")
    late, late_result = make_job(mlp_input(), timeout_us=1000, age_s=10.0)
    ok, ok_result = make_job(mlp_input(), timeout_us=0, age_s=10.0)
    scheduler.submit(late)
    scheduler.submit(ok)
    assert _status(late_result.error()) is Status.UNAVAILABLE
    assert ok_result.outputs()["OUTPUT0"].shape == (1, 4)


def test_backend_exception_fails_that_batch_only(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    held = _hold_worker(scheduler, instance)
    instance.fail_on_call[2] = RuntimeError("boom")
    batch = [make_job(mlp_input(seed=i)) for i in range(2)]
    for job, _ in batch:
        scheduler.submit(job)
    instance.gate.set()
    assert held.outputs()["OUTPUT0"].shape == (1, 4)
    for _, result in batch:
        error = result.error()
        assert _status(error) is Status.INTERNAL
        assert error.message == "mlp version 1: boom"
        assert result.calls == 1
    after, after_result = make_job(mlp_input())
    scheduler.submit(after)
    assert after_result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(WAIT_S)
    snap = scheduler.stats.snapshot()
    assert (snap.success.count, snap.fail.count, snap.fail_by_reason["BACKEND"]) == (2, 2, 2)
    assert batch_sizes(scheduler.stats.to_dict()) == {1: 2}  # the failed batch is not an execution


def test_a_failing_callback_does_not_stop_the_worker(make_scheduler):
    scheduler, _ = make_scheduler("mlp", "max_batch_size: 8\n")
    job, _ = make_job(mlp_input())

    def explode(_: object) -> None:
        raise ValueError("callback bug")

    job.done = explode
    scheduler.submit(job)
    after, result = make_job(mlp_input())
    scheduler.submit(after)
    assert result.outputs()["OUTPUT0"].shape == (1, 4)


async def test_drain_completes_queued_jobs_then_refuses_new_ones(make_scheduler):
    config = "max_batch_size: 2\ndynamic_batching { }\n"
    scheduler, (instance,) = make_scheduler("mlp", config, open_gate=False)
    held = _hold_worker(scheduler, instance)
    queued = [make_job(mlp_input(seed=i)) for i in range(5)]
    for job, _ in queued:
        scheduler.submit(job)
    drain = asyncio.ensure_future(scheduler.drain(WAIT_S))
    await asyncio.sleep(0)  # let drain() start: it stops accepting before its first await
    with pytest.raises(InferenceError, match="is not available") as info:
        scheduler.submit(make_job(mlp_input())[0])
    assert info.value.status is Status.UNAVAILABLE
    instance.gate.set()
    assert await drain
    assert held.outputs()["OUTPUT0"].shape == (1, 4)
    for _, result in queued:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.pending_count == 0
    assert scheduler.stats.to_dict()["inference_count"] == 6
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("edgeserve-mlp-v1-"))


async def test_drain_timeout_leaves_the_rest_to_close(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", "max_batch_size: 8\n", open_gate=False)
    held = _hold_worker(scheduler, instance)
    job, result = make_job(mlp_input())
    scheduler.submit(job)
    assert not await scheduler.drain(0.05)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    assert _status(result.error()) is Status.UNAVAILABLE  # failed by close() while the worker is busy
    instance.gate.set()
    closer.join(WAIT_S)
    assert held.outputs()["OUTPUT0"].shape == (1, 4)


def test_close_fails_queued_jobs_and_refuses_new_ones(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    held = _hold_worker(scheduler, instance)
    queued = [make_job(mlp_input(seed=i)) for i in range(3)]
    for job, _ in queued:
        scheduler.submit(job)
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    for _, result in queued:
        error = result.error()
        assert _status(error) is Status.UNAVAILABLE
        assert error.message == "model 'mlp' version 1 is not available (unloading)"
    instance.gate.set()  # the running batch still finishes
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert held.outputs()["OUTPUT0"].shape == (1, 4)
    assert instance.closed
    with pytest.raises(InferenceError) as info:
        scheduler.submit(make_job(mlp_input())[0])
    assert info.value.status is Status.UNAVAILABLE
    assert info.value.message == "model 'mlp' version 1 is not available (unloading)"


async def test_drain_of_an_idle_scheduler_returns_at_once(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8)
    assert await scheduler.drain(WAIT_S)
    scheduler.close()
    assert instance.closed


def test_bad_default_priority_level_fails_at_construction(make_scheduler):
    config = "max_batch_size: 8\ndynamic_batching { priority_levels: 2 default_priority_level: 3 }\n"
    with pytest.raises(InferenceError, match="default_priority_level") as info:
        make_scheduler("mlp", config)
    assert info.value.status is Status.INVALID_ARG
