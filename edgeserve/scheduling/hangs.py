"""The stateless scheduler's watchdog (scheduler.py): hangs and request timeouts while a batch runs.

One watchdog thread checks every scheduler's running batches. A job whose own deadline (request or
policy timeout) passes while its batch runs is answered at once (UNAVAILABLE "Request timeout
expired"). A batch still running after `hang_timeout_s` marks its instance hung: every job of the
batch is answered (UNAVAILABLE), the worker thread is abandoned (a thread cannot be killed; when the
call returns it closes the old instance and exits) and a fresh instance from `instance_factory`
takes its place with a new worker. A result that arrives after its job was answered is dropped.

`check_running(now_ns)` takes the time from its caller (the watchdog passes its clock; tests pass
the time they want), so hang and timeout handling is tested without waiting.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgeserve.backends.watch_thread import WatchThread
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.queue import TIMEOUT_MESSAGE

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.scheduler")

_NS_PER_S = 1_000_000_000
WATCHDOG_INTERVAL_S = 0.05
HUNG_MESSAGE = "instance {index} did not answer in {seconds:g} s; it is being replaced"

InstanceFactory = Callable[[], "Instance"]


def load_replacement(
    factory: InstanceFactory, model: str, version: int, index: int, logger: logging.Logger
) -> Instance | None:
    """A fresh instance for the hung one at `index`; None (and the traceback logged) when loading fails."""
    try:
        return factory()
    except Exception:
        logger.exception("%s version %d: loading a replacement for instance %d failed", model, version, index)
        return None


class _Watchdog(WatchThread["HangWatch"]):
    """One daemon thread for every scheduler in the process: cheap checks of the running batches."""

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_S)
            self._check()  # its locals go with it: no strong reference to a retired scheduler stays

    def _check(self) -> None:
        now = time.monotonic_ns()
        for scheduler in self.watched():
            try:
                scheduler.check_running(now)
            except Exception:  # pragma: no cover - a bug here must not stop the watchdog
                log.exception("watchdog check of %s failed", scheduler.model_name)


_WATCHDOG = _Watchdog("edgeserve-watchdog")


class HangWatch:
    """The Scheduler's hang and running-timeout handling (a mixin: the state is the Scheduler's)."""

    model_name: str
    version: int
    _lock: threading.Lock
    _work: threading.Condition
    _instances: list[Instance]
    _threads: list[threading.Thread]
    _batches: dict[int, tuple[list[Job], int]]  # instance index -> (jobs, start)
    _generation: list[int]
    _claimed: set[int]
    _running: set[int]
    _replacing: set[int]
    _executing: int
    _hang_ns: int
    _factory: InstanceFactory | None
    _closed: bool
    _stopping: bool
    replaced: int
    _check_streams: Callable[[int], None]  # decoupled.py: live streams past their deadline

    def _claim(self, jobs: list[Job]) -> list[Job]:
        raise NotImplementedError

    def _fail(self, jobs: list[Job], error: InferenceError, reason: str, *, claim: bool = True) -> None:
        raise NotImplementedError

    def _is_idle(self) -> bool:
        raise NotImplementedError

    def _notify_idle(self) -> None:
        raise NotImplementedError

    def _make_thread(self, index: int, instance: Instance, generation: int) -> threading.Thread:
        raise NotImplementedError

    def check_running(self, now_ns: int) -> None:
        """Watchdog (its own thread): answer executing jobs past their deadline; replace an instance
        whose batch has run longer than the hang timeout."""
        self._check_streams(now_ns)
        if not self._batches:
            return
        timed_out: list[Job] = []
        hung: list[tuple[int, list[Job]]] = []
        with self._lock:
            for index, (jobs, start_ns) in list(self._batches.items()):
                if self._hang_ns and now_ns - start_ns >= self._hang_ns:
                    del self._batches[index]
                    hung.append((index, self._claim(jobs)))
                    self._generation[index] += 1
                    self._claimed.discard(index)
                    self._running.discard(index)
                    self._executing -= 1
                    self._replacing.add(index)
                    self._work.notify_all()  # an idle worker of a replaced (inline-run) instance exits
                    continue
                late = [j for j in jobs if j.deadline_ns and j.deadline_ns <= now_ns and not j.finished]
                if late:
                    timed_out.extend(self._claim(late))
            if hung and self._is_idle():
                self._notify_idle()
        if timed_out:
            error = InferenceError(Status.UNAVAILABLE, TIMEOUT_MESSAGE)
            self._fail(timed_out, error, "REJECTED", claim=False)
        for index, jobs in hung:
            seconds = self._hang_ns / _NS_PER_S
            log.error("%s version %d: instance %d hung (no answer in %g s); replacing it",
                      self.model_name, self.version, index, seconds)  # fmt: skip
            message = HUNG_MESSAGE.format(index=index, seconds=seconds)
            prefix = f"{self.model_name} version {self.version}: "
            self._fail(jobs, InferenceError(Status.UNAVAILABLE, prefix + message), "BACKEND", claim=False)
            threading.Thread(target=self._replace, args=(index,), daemon=True,
                             name=f"edgeserve-{self.model_name}-replace-{index}").start()  # fmt: skip

    def _replace(self, index: int) -> None:
        """Load a fresh instance for the hung one at `index` and start its worker."""
        instance = None
        if self._factory is not None:
            instance = load_replacement(self._factory, self.model_name, self.version, index, log)
        with self._lock:
            self._replacing.discard(index)
            if instance is None or self._closed or self._stopping:
                keep = None
            else:
                keep = instance
                self._instances[index] = instance
                thread = self._make_thread(index, instance, self._generation[index])
                self._threads[index] = thread
                self.replaced += 1
                thread.start()
        if instance is not None and keep is None:
            with contextlib.suppress(Exception):
                instance.close()
        elif keep is not None:
            log.info("%s version %d: instance %d replaced", self.model_name, self.version, index)
        else:
            log.error("%s version %d: instance %d stays out of service (no replacement)",
                      self.model_name, self.version, index)  # fmt: skip

    @property
    def replacing(self) -> int:
        return len(self._replacing)
