"""The repository's side of the memory budget: reserve before a load, measure it, evict through the
repository's drained unload path, load on first use, and show it all (index reasons, metrics).

`ModelRepository` holds one `MemoryBudget` (`repository.budget`) and calls it from a few hooks; the
policy itself (costs, LRU choice, the error when nothing fits) is `residency.Residency`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from edgeserve.metrics import register_collector, unregister_collector
from edgeserve.protocol.errors import InferenceError, unavailable
from edgeserve.repository import ensembles
from edgeserve.repository.residency import (
    EVICTED_REASON,
    FIRST_USE_REASON,
    MIB,
    Charge,
    Residency,
    floor_bytes,
    model_flags,
    param_true,
    rss_bytes,
)

if TYPE_CHECKING:
    from edgeserve.repository.served import PreparedVersion, ServedModel

log = logging.getLogger("edgeserve.repository.budget")

T = TypeVar("T")
UNLOADED, UNAVAILABLE = "unloaded", "UNAVAILABLE"


class Repository(Protocol):
    """What the budget uses of the ModelRepository that holds it (manager.py): its settings and
    selector, its models and served versions (read only), and its drained load and unload paths."""

    settings: Any
    selector: Any
    _closing: bool

    @property
    def _models(self) -> Mapping[str, Any]: ...  # name -> the model's lock, states, `wanted`

    @property
    def _served(self) -> Mapping[str, Mapping[int, ServedModel]]: ...

    def folders(self) -> dict[str, Path]: ...

    def is_ready(self, name: str, version: str = "") -> bool: ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...


def budget_from(settings: Any, selector: Any) -> tuple[int | None, str]:
    """(bytes the models may hold together, where that figure comes from)."""
    configured = int(getattr(getattr(settings, "repository", None), "memory_budget_mb", 0) or 0)
    if configured > 0:
        return configured * MIB, "[repository] memory_budget_mb"
    planner: Any = getattr(selector, "planner", None)
    total = planner.memory_budget() if planner is not None else None
    if planner is None or total is None:
        return None, "no memory budget known"
    baseline = rss_bytes()
    reason = f"device memory budget {total / MIB:.0f} MiB ({planner.hw.budget.memory_reason}, less the "
    reason += f"profile's headroom) less the server's own {baseline / MIB:.0f} MiB"
    return max(0, total - baseline), reason


def malloc_trim() -> None:
    """glibc keeps freed heap pages; after an unload, hand them back to the system (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def effective_cpus(selector: Any) -> int:
    planner = getattr(selector, "planner", None)
    if planner is not None:
        return max(1, int(planner.hw.budget.effective_cpus))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class MemoryBudget:
    def __init__(self, repository: Repository) -> None:
        self.repo = repository
        self.residency = Residency(*budget_from(repository.settings, repository.selector))
        self.load_wait_s = float(
            getattr(getattr(repository.settings, "repository", None), "load_wait_s", 60.0)
        )
        self._loads: dict[str, asyncio.Task[None]] = {}  # on-demand loads in progress
        self._pending_prepared: dict[int, Charge] = {}  # id(prepared version) -> its charge
        self._evicting: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collector = _Collector(self)
        self.autoscaler: Any = None  # scheduling.autoscale.Autoscaler, started with the repository

    # -- start / close -----------------------------------------------------------------------------
    def startup(self, names: Iterable[str]) -> list[str]:
        """The start-up models less the load-on-first-use ones (recorded, shown in the index)."""
        from edgeserve.scheduling.autoscale import Autoscaler

        self._loop = asyncio.get_running_loop()
        register_collector(self._collector)
        folders = self.repo.folders()
        for name, folder in folders.items():
            self.residency.note_flags(name, *model_flags(folder))
        if self.residency.budget_bytes is not None:
            log.info("memory budget for models: %.0f MiB (%s)", self.residency.budget_bytes / MIB,
                     self.residency.budget_reason)  # fmt: skip
        self.autoscaler = Autoscaler(self, effective_cpus(self.repo.selector))
        self.autoscaler.start()
        deferred = [n for n in names if n in self.residency.first_use]
        if deferred:
            log.info("load on first use (not loaded now): %s", ", ".join(deferred))
        return [n for n in names if n not in self.residency.first_use]

    async def close(self) -> None:
        unregister_collector(self._collector)
        if self.autoscaler is not None:
            await self.autoscaler.stop()

    # -- loads -------------------------------------------------------------------------------------
    async def prepare(self, name: str, version: int, version_dir: Path, raw_config: Any,
                      slots: asyncio.Semaphore, fn: Callable[..., PreparedVersion],
                      *args: Any) -> PreparedVersion:  # fmt: skip
        """Reserve memory for the version (evicting LRU models when needed), then run `fn(*args)` in
        a worker thread within `slots`, measuring what it cost."""
        self.residency.note_flags(name, param_true(raw_config, "load_on_first_use"),
                                  param_true(raw_config, "pinned"))  # fmt: skip
        self.residency.held_off.discard(name)
        counts = [int(g.count) for g in getattr(raw_config, "instance_group", [])]
        estimate = self.residency.estimate(name, version, version_dir, max(1, sum(counts)))
        charge = await self.residency.reserve(name, version, estimate, self.evictable, self.evict)
        try:
            async with slots:
                prepared = await asyncio.to_thread(self._measured, charge, version_dir, fn, *args)
        except BaseException:
            self.residency.cancel(charge)
            raise
        self._pending_prepared[id(prepared)] = charge
        await self.residency.trim(name, self.evictable, self.evict)  # it cost more than estimated
        return prepared

    def _measured(self, charge: Charge, version_dir: Path, fn: Callable[..., T], *args: Any) -> T:
        malloc_trim()  # both figures without freed-but-kept heap: what the model holds, not the garbage
        modules, before = len(sys.modules), rss_bytes(children=True)
        result = fn(*args)
        malloc_trim()
        growth = rss_bytes(children=True) - before
        if len(sys.modules) > modules:  # it imported a runtime: that memory is the server's, not the model's
            growth = 0
        instances = len(getattr(result, "instances", ()) or ()) or 1
        self.residency.measured(charge, growth, floor_bytes(version_dir, instances))
        return result

    def serve(self, prepared: PreparedVersion, build: Callable[[], ServedModel]) -> ServedModel:
        """`build()` the served model; it holds the prepared version's charge until it retires."""
        charge = self._pending_prepared.pop(id(prepared), None)
        try:
            served = build()
        except BaseException:
            if charge is not None:
                self.residency.cancel(charge)
            raise
        if charge is not None:
            self.residency.settle(charge, served)
        return served

    def retired(self, served: ServedModel) -> None:
        self.residency.release(served)

    # -- eviction ----------------------------------------------------------------------------------
    def evictable(self, name: str) -> bool:
        """Idle: not loading or unloading, no request queued or running, not serving an ensemble."""
        model = self.repo._models.get(name)
        if model is None or model.lock.locked() or name in self._loads:
            return False
        if ensembles.dependents(self.repo._served, name):
            return False
        for served in self.repo._served.get(name, {}).values():
            if served.config.WhichOneof("scheduling_choice") == "sequence_batching":
                return False  # live sequences hold state an unload would lose
            wait_idle = getattr(served.scheduler, "wait_idle", None)
            if wait_idle is None or not wait_idle(0):
                return False
        return True

    async def evict(self, name: str) -> None:
        self.residency.evicted.add(name)  # from now on a request for it waits for its reload
        self._evicting.add(name)
        try:
            await self.repo.unload(name)
        finally:
            self._evicting.discard(name)
        await asyncio.to_thread(malloc_trim)  # give the freed heap back, so RSS follows the budget

    def unloaded(self, name: str) -> None:
        """An explicit unload: the model stays unloaded (no load on demand) until loaded again."""
        if name not in self._evicting:
            self.residency.evicted.discard(name)
            self.residency.held_off.add(name)

    # -- load on first use -------------------------------------------------------------------------
    def load_on_demand(
        self, name: str, version: str = "", timeout_s: float = 0.0
    ) -> concurrent.futures.Future[None] | None:
        """For a request to `name` that is not loaded: None when it is not a load-on-first-use or
        evicted model; else a future done when it serves (or failed, UNAVAILABLE). Any thread.
        Requests for the same model wait on one load; each waits at most `timeout_s`."""
        loop = self._loop
        if loop is None or self.repo._closing or not self.residency.on_demand(name):
            return None
        wait = timeout_s if timeout_s > 0 else self.load_wait_s
        return asyncio.run_coroutine_threadsafe(self._wait(name, wait), loop)

    async def _wait(self, name: str, timeout_s: float) -> None:
        task = self._loads.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name))
            self._loads[name] = task
            task.add_done_callback(lambda done: self._loads.pop(name, None) if self._loads.get(name) is done
                                   else None)  # fmt: skip
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct types before Python 3.11
            raise unavailable(f"model '{name}' is loading (load on first use) and did not serve within "
                              f"{timeout_s:g} s; retry") from None  # fmt: skip
        except InferenceError as exc:
            raise unavailable(f"model '{name}' could not be loaded for this request: {exc.message}") from None

    async def _load(self, name: str) -> None:
        if not self.repo.is_ready(name):
            log.info("model %s: loading for a request (%s)", name,
                     "load on first use" if name in self.residency.first_use else EVICTED_REASON)  # fmt: skip
            try:
                await self.repo.load(name)
            except BaseException:
                model = self.repo._models.get(name)
                if model is not None:
                    model.wanted = False  # a failed load on demand does not make the server unready
                raise

    # -- what the index shows ----------------------------------------------------------------------
    def reason(self, name: str, state: str, reason: str) -> tuple[str, str]:
        """(state, reason) for an index entry, with the residency's explanation where it has one."""
        if state == "" and not reason and name in self.residency.first_use:
            return UNAVAILABLE, FIRST_USE_REASON
        if state == UNAVAILABLE and reason == UNLOADED and name in self.residency.evicted:
            return state, EVICTED_REASON
        return state, reason


def instance_count(scheduler: Any) -> int:
    from edgeserve.scheduling.autoscale import instance_count as count

    return count(scheduler)


class _Collector:
    """edgeserve_memory_budget_bytes, edgeserve_model_resident / _memory_bytes / _instances,
    edgeserve_evictions_total."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        residency = self.budget.residency
        repo = self.budget.repo
        limit = GaugeMetricFamily("edgeserve_memory_budget_bytes", "Memory the models may hold together "
                                  "(0 = no budget)")  # fmt: skip
        limit.add_metric([], float(residency.budget_bytes or 0))
        yield limit
        used = GaugeMetricFamily("edgeserve_memory_used_bytes", "Memory held by resident models (measured)")
        used.add_metric([], float(residency.used()))
        yield used
        resident = residency.resident()
        names = sorted(set(repo._models) | residency.first_use | set(resident))
        flag = GaugeMetricFamily("edgeserve_model_resident", "1 while a version of the model is loaded",
                                 labels=["model"])  # fmt: skip
        memory = GaugeMetricFamily("edgeserve_model_memory_bytes", "Memory the model's loaded versions hold",
                                   labels=["model"])  # fmt: skip
        instances = GaugeMetricFamily("edgeserve_model_instances", "Execution instances of the model's "
                                      "loaded versions", labels=["model"])  # fmt: skip
        evictions = CounterMetricFamily("edgeserve_evictions", "Unloads of the model to fit the memory "
                                        "budget", labels=["model"])  # fmt: skip
        for name in names:
            served = list(repo._served.get(name, {}).values())
            flag.add_metric([name], 1.0 if served else 0.0)
            memory.add_metric([name], float(resident.get(name, 0)))
            count = sum(instance_count(s.scheduler) for s in served)
            instances.add_metric([name], float(count))
            evictions.add_metric([name], float(residency.evictions.get(name, 0)))
        yield from (flag, memory, instances, evictions)
