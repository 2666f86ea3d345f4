"""Instance autoscaling: the policy with a fake clock, adding/removing instances of a real scheduler
(gated instances, so the queue is known exactly), and the autoscaler's step end to end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from conftest import SchedulerFactory
from sched_helpers import GatedInstance, make_config, make_job, mlp_input

from edgeserve.repository.residency import Residency
from edgeserve.scheduling import instance_pool
from edgeserve.scheduling.autoscale import Autoscaler, ScaleRule, ScaleState, decide, rule_for

BATCHING = "max_batch_size: 4\n"
OPT_IN = (
    'parameters { key: "autoscale" value { string_value: "true" } }\n'
    'parameters { key: "autoscale_max_instances" value { string_value: "3" } }\n'
    'parameters { key: "autoscale_busy_s" value { string_value: "1" } }\n'
    'parameters { key: "autoscale_idle_s" value { string_value: "5" } }\n'
)


def test_grows_only_after_the_queue_stayed_deep_and_shrinks_only_after_a_long_idle() -> None:
    rule = ScaleRule(min_instances=1, max_instances=3, queue_depth=2, busy_s=1.0, idle_s=5.0, cooldown_s=2.0)
    state = ScaleState()
    assert decide(rule, state, 0.0, queued=5, idle=False, instances=1) == 0  # deep, but not for long
    assert decide(rule, state, 0.5, queued=1, idle=False, instances=1) == 0  # a dip resets the timer
    assert decide(rule, state, 1.2, queued=3, idle=False, instances=1) == 0
    assert decide(rule, state, 2.3, queued=3, idle=False, instances=1) == 1
    state.changed_at = 2.3
    assert decide(rule, state, 3.5, queued=3, idle=False, instances=2) == 0  # cooldown (hysteresis)
    assert decide(rule, state, 4.4, queued=3, idle=False, instances=2) == 1
    state.changed_at = 4.4
    assert decide(rule, state, 9.0, queued=9, idle=False, instances=3) == 0  # at the maximum
    assert decide(rule, state, 10.0, queued=0, idle=True, instances=3) == 0  # idle, not for long yet
    assert decide(rule, state, 14.9, queued=0, idle=True, instances=3) == 0
    assert decide(rule, state, 15.0, queued=0, idle=True, instances=3) == -1
    state.changed_at = 15.0
    assert decide(rule, state, 16.0, queued=0, idle=True, instances=2) == 0  # cooldown again
    assert decide(rule, state, 17.1, queued=0, idle=True, instances=2) == -1
    assert decide(rule, state, 30.0, queued=0, idle=True, instances=1) == 0  # at the minimum


def test_opt_in_and_bounds_come_from_the_config() -> None:
    assert rule_for(make_config(BATCHING), 1, 8) is None
    rule = rule_for(make_config(BATCHING + OPT_IN), 1, 8)
    assert rule is not None and (rule.min_instances, rule.max_instances) == (1, 3)
    defaults = rule_for(
        make_config(BATCHING + 'parameters { key: "autoscale" value { string_value: "1" } }'), 2, 4
    )
    assert defaults is not None and (defaults.min_instances, defaults.max_instances) == (2, 4)


def test_grow_and_shrink_a_running_scheduler(make_scheduler: SchedulerFactory) -> None:
    scheduler, gated = make_scheduler("mlp", BATCHING, instances=1, open_gate=False)
    extra = GatedInstance(gated[0].inner, open_gate=False)
    assert instance_pool.grow(scheduler, extra)
    assert instance_pool.active_count(scheduler) == 2
    jobs = [make_job(mlp_input(1, fill=float(i))) for i in range(2)]
    for job, _ in jobs:
        scheduler.submit(job)
    gated[0].wait_entered()
    extra.wait_entered()  # both instances run at once
    assert instance_pool.shrink(scheduler, 1) is None  # busy: never cut a batch short
    gated[0].gate.set()
    extra.gate.set()
    for _, result in jobs:
        assert result.outputs()["OUTPUT0"].shape == (1, 4)
    assert scheduler.wait_idle(5.0)
    retired = instance_pool.shrink(scheduler, 1)
    assert retired is extra
    assert instance_pool.active_count(scheduler) == 1
    assert instance_pool.shrink(scheduler, 1) is None  # never below the minimum
    job, result = make_job(mlp_input(2))
    scheduler.submit(job)
    assert result.outputs()["OUTPUT0"].shape == (2, 4)  # the remaining instance serves
    again = GatedInstance(gated[0].inner)
    assert instance_pool.grow(scheduler, again)  # reuses the retired slot
    assert len(scheduler._instances) == 2 and instance_pool.active_count(scheduler) == 2


@dataclass
class FakeServed:
    name: str
    version: int
    config: Any
    scheduler: Any


class FakeBudget:
    """What the autoscaler needs of the repository's MemoryBudget."""

    def __init__(self, served: FakeServed) -> None:
        self.repo = type("Repo", (), {"_served": {served.name: {served.version: served}}})()
        self.residency = Residency(None, "no budget")

    def evictable(self, name: str) -> bool:
        return False

    async def evict(self, name: str) -> None:  # pragma: no cover - no budget, nothing evicted
        raise AssertionError(name)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_autoscaler_grows_under_a_queue_and_shrinks_when_idle(make_scheduler: SchedulerFactory) -> None:
    made: list[GatedInstance] = []

    def factory() -> GatedInstance:
        instance = GatedInstance(gated[0].inner, open_gate=False)
        made.append(instance)
        return instance

    scheduler, gated = make_scheduler("mlp", BATCHING + OPT_IN, instances=1, open_gate=False,
                                      instance_factory=factory)  # fmt: skip
    served = FakeServed("mlp", 1, scheduler.config, scheduler)
    clock = Clock()
    scaler = Autoscaler(FakeBudget(served), cpus=4, clock=clock)
    jobs = [make_job(mlp_input(4, seed=i)) for i in range(6)]  # full batches: one per call
    for job, _ in jobs:
        scheduler.submit(job)
    gated[0].wait_entered()  # one runs, five wait
    await scaler.step()
    clock.now += 1.5
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 2 and len(made) == 1
    made[0].wait_entered()  # the new instance took work from the queue
    clock.now += 0.5
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 2  # cooldown
    clock.now += 2.0
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 3 and len(made) == 2
    clock.now += 10.0
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 3  # the maximum (autoscale_max_instances 3)

    for instance in (*gated, *made):
        instance.gate.set()
    expected = [gated[0].inner.infer(job.inputs)["OUTPUT0"] for job, _ in jobs]
    for (_, result), want in zip(jobs, expected, strict=True):
        np.testing.assert_allclose(result.outputs()["OUTPUT0"], want, rtol=1e-5)
    assert scheduler.wait_idle(5.0)
    await scaler.step()  # idle from now
    clock.now += 4.0
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 3
    clock.now += 1.5
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 2
    clock.now += 2.5
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 1
    clock.now += 60.0
    await scaler.step()
    assert instance_pool.active_count(scheduler) == 1  # the configured count is the minimum
    assert sum(i.closed for i in made) == 2 and scaler.changes == 4


async def test_no_instance_past_the_cpu_budget(make_scheduler: SchedulerFactory) -> None:
    made: list[GatedInstance] = []

    def factory() -> GatedInstance:  # pragma: no cover - must not be called
        made.append(GatedInstance(gated[0].inner))
        return made[-1]

    scheduler, gated = make_scheduler("mlp", BATCHING + OPT_IN, instances=1, open_gate=False,
                                      instance_factory=factory)  # fmt: skip
    clock = Clock()
    scaler = Autoscaler(FakeBudget(FakeServed("mlp", 1, scheduler.config, scheduler)), cpus=1, clock=clock)
    jobs = [make_job(mlp_input(4, seed=i)) for i in range(4)]
    for job, _ in jobs:
        scheduler.submit(job)
    gated[0].wait_entered()
    for _ in range(5):
        await scaler.step()
        clock.now += 1.5
    assert instance_pool.active_count(scheduler) == 1 and made == []  # 1 instance x 1 thread = 1 CPU
    gated[0].gate.set()
    for _, result in jobs:
        assert result.outputs()["OUTPUT0"].shape == (4, 4)
