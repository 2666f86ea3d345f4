"""Instance autoscaling: more instances while a model's queue stays deep, fewer once it is idle.

Opt-in per model, in its config (Triton has no standard for this, so it lives in `parameters`):

    parameters { key: "autoscale" value { string_value: "true" } }
    parameters { key: "autoscale_max_instances" value { string_value: "4" } }   # optional
    parameters { key: "autoscale_queue_depth" value { string_value: "2" } }     # optional
    parameters { key: "autoscale_busy_s" value { string_value: "1" } }          # optional
    parameters { key: "autoscale_idle_s" value { string_value: "30" } }         # optional

The configured `instance_group` count is the minimum. Every `INTERVAL_S` the queue of each such
model is sampled: when at least `autoscale_queue_depth` requests wait at every sample for
`autoscale_busy_s`, one instance is added (loaded and warmed up like the others) if the CPU budget
allows it (all models' instances x their threads <= the effective CPUs of the hardware probe) and
the memory budget has room (LRU models are evicted for it as for any load); when the model is idle
(nothing queued or running) at every sample for `autoscale_idle_s`, one extra instance is removed.
After any change the model waits `COOLDOWN_S` (hysteresis). Monotonic clock; one change at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgeserve.scheduling import instance_pool
from edgeserve.scheduling.scheduler import Scheduler

log = logging.getLogger("edgeserve.scheduling.autoscale")

INTERVAL_S = 0.25
COOLDOWN_S = 2.0
DEFAULT_QUEUE_DEPTH = 2
DEFAULT_BUSY_S = 1.0
DEFAULT_IDLE_S = 30.0
MAX_INSTANCES = 64  # whatever the config says


@dataclass(frozen=True)
class ScaleRule:
    min_instances: int
    max_instances: int
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    busy_s: float = DEFAULT_BUSY_S
    idle_s: float = DEFAULT_IDLE_S
    cooldown_s: float = COOLDOWN_S


@dataclass
class ScaleState:
    busy_since: float | None = None
    idle_since: float | None = None
    changed_at: float = float("-inf")


def decide(rule: ScaleRule, state: ScaleState, now: float, queued: int, idle: bool, instances: int) -> int:
    """+1 (add an instance), -1 (remove one) or 0, from one sample; updates `state`. Pure."""
    state.busy_since = (state.busy_since if state.busy_since is not None else now) if (
        queued >= rule.queue_depth) else None  # fmt: skip
    state.idle_since = (state.idle_since if state.idle_since is not None else now) if idle else None
    if now - state.changed_at < rule.cooldown_s:
        return 0
    busy = state.busy_since is not None and now - state.busy_since >= rule.busy_s
    if busy and instances < rule.max_instances:
        return 1
    idle_long = state.idle_since is not None and now - state.idle_since >= rule.idle_s
    if idle_long and instances > rule.min_instances:
        return -1
    return 0


def _param(config: Any, key: str, default: float) -> float:
    if key not in config.parameters:
        return default
    try:
        value = float(config.parameters[key].string_value)
    except ValueError:
        return default
    return value if value > 0 else default


def rule_for(config: Any, configured: int, cpus: int) -> ScaleRule | None:
    """The model's rule, or None when it does not opt in (`parameters { key: "autoscale" }`)."""
    if "autoscale" not in config.parameters:
        return None
    if config.parameters["autoscale"].string_value.strip().lower() not in ("1", "true", "yes", "on"):
        return None
    low = max(1, configured)
    high = int(_param(config, "autoscale_max_instances", float(max(low, cpus))))
    return ScaleRule(
        min_instances=low,
        max_instances=max(low, min(high, MAX_INSTANCES)),
        queue_depth=max(1, int(_param(config, "autoscale_queue_depth", DEFAULT_QUEUE_DEPTH))),
        busy_s=_param(config, "autoscale_busy_s", DEFAULT_BUSY_S),
        idle_s=_param(config, "autoscale_idle_s", DEFAULT_IDLE_S),
    )


def instance_threads(scheduler: Any, cpus: int) -> int:
    """CPU threads one instance of the model uses: its `threads` (0 = the runtime's default: all
    `cpus`), 1 when the backend does not say."""
    instances = instance_pool.live_instances(scheduler) if isinstance(scheduler, Scheduler) else []
    threads = getattr(instances[0], "threads", 1) if instances else 1
    if not isinstance(threads, int) or threads < 0:
        return 1
    return threads if threads > 0 else cpus


def instance_count(scheduler: Any) -> int:
    if isinstance(scheduler, Scheduler):
        return instance_pool.active_count(scheduler)
    return int(getattr(scheduler, "instance_count", 1) or 1)


class Autoscaler:
    """Owned by the repository's `MemoryBudget`: `start()` with the repository, `stop()` at close."""

    def __init__(self, budget: Any, cpus: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget  # repository.budget.MemoryBudget (its repo, residency, evict helpers)
        self.cpus = cpus
        self._clock = clock
        self._states: dict[int, tuple[Scheduler, ScaleState, int]] = {}  # id(scheduler) -> (s, state, min)
        self._task: asyncio.Task[None] | None = None
        self.changes = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="edgeserve-autoscale")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL_S)
            try:
                await self.step()
            except Exception:
                log.exception("autoscale step failed")

    def _served(self) -> list[Any]:
        return [s for versions in list(self.budget.repo._served.values()) for s in versions.values()]

    def threads_in_use(self) -> int:
        return sum(
            instance_count(s.scheduler) * instance_threads(s.scheduler, self.cpus) for s in self._served()
        )

    async def step(self) -> None:
        """Sample every opted-in model once and make at most one change per model."""
        now = self._clock()
        live: set[int] = set()
        for served in self._served():
            scheduler = served.scheduler
            if type(scheduler) is not Scheduler or scheduler._factory is None:
                continue
            key = id(scheduler)
            entry = self._states.get(key)
            if entry is None or entry[0] is not scheduler:
                entry = (scheduler, ScaleState(), len(scheduler._instances))
                self._states[key] = entry
            rule = rule_for(served.config, entry[2], self.cpus)
            if rule is None:
                continue
            live.add(key)
            count = instance_pool.active_count(scheduler)
            verdict = decide(rule, entry[1], now, scheduler.pending_count, scheduler.wait_idle(0), count)
            if verdict > 0:
                changed = await self._grow(served, scheduler, count)
            else:
                changed = verdict < 0 and await self._shrink(served, scheduler, rule.min_instances)
            if changed:
                entry[1].changed_at = self._clock()
        for key in [k for k in self._states if k not in live]:
            del self._states[key]

    async def _grow(self, served: Any, scheduler: Scheduler, count: int) -> bool:
        per_thread = instance_threads(scheduler, self.cpus)
        if self.threads_in_use() + per_thread > self.cpus:
            return False  # the CPU budget is spent
        residency = self.budget.residency
        held = residency.charge_of(served)
        per_instance = held.nbytes // max(1, count) if held is not None else 0
        try:
            charge = await residency.reserve(served.name, served.version, per_instance,
                                             self.budget.evictable, self.budget.evict)  # fmt: skip
        except Exception as exc:  # no memory for it: stay as we are
            log.info("autoscale: %s stays at %d instance(s): %s", served.name, count, exc)
            return False
        factory = scheduler._factory
        if factory is None:
            return False
        try:
            instance = await asyncio.to_thread(factory)
        except Exception:
            residency.cancel(charge)
            log.exception("autoscale: %s: loading one more instance failed", served.name)
            return False
        residency.cancel(charge)
        if not instance_pool.grow(scheduler, instance):
            await asyncio.to_thread(instance.close)
            return False
        residency.grow(served, per_instance)
        self.changes += 1
        log.info("autoscale: %s version %d: %d -> %d instances (queue %d)", served.name, served.version,
                 count, count + 1, scheduler.pending_count)  # fmt: skip
        return True

    async def _shrink(self, served: Any, scheduler: Scheduler, minimum: int) -> bool:
        count = instance_pool.active_count(scheduler)
        instance = await asyncio.to_thread(instance_pool.shrink, scheduler, minimum)
        if instance is None:
            return False
        await asyncio.to_thread(instance.close)
        held = self.budget.residency.charge_of(served)
        if held is not None:
            self.budget.residency.grow(served, -(held.nbytes // max(1, count)))
        self.changes += 1
        log.info("autoscale: %s version %d: %d -> %d instances (idle)", served.name, served.version,
                 count, count - 1)  # fmt: skip
        return True
