"""The sequence batcher's threads and lifecycle: one worker per instance, the reaper (idle sequences
lose their place; a batch running past the hang timeout is answered and its instance replaced),
drain and close. `SequenceBatcher` (sequence.py) adds the queueing and the batches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.hangs import load_replacement
from edgeserve.scheduling.job import Arrays, Job, answer
from edgeserve.scheduling.sequence_config import SequenceKey, SequenceSpec
from edgeserve.scheduling.sequence_run import Sequence, Step
from edgeserve.scheduling.stats import ModelStats

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.sequence")

Batch = list[tuple[int, Sequence, Step]]  # (row, sequence, its request), sorted by row
InstanceFactory = Callable[[], "Instance"]
EXPIRED_MEMORY = 1024  # IDs of sequences freed by the idle timeout, for a clearer error


class SequenceLifecycle:
    model_name: str
    version: int
    stats: ModelStats
    spec: SequenceSpec
    _instances: list[Instance]
    _slots: list[list[Sequence | None]]
    _sequences: dict[SequenceKey, Sequence]
    _backlog: deque[Sequence]
    _lock: threading.Lock
    _work: threading.Condition
    _pending: int
    _accepting: bool

    def _init_lifecycle(self, hang_timeout_s: float, factory: InstanceFactory | None) -> None:
        self._idle = threading.Condition(self._lock)
        self._reaper_wake = threading.Condition(self._lock)
        self._workers: list[threading.Thread] = []
        self._helpers: list[threading.Thread] = []  # the reaper and instance replacements
        self._expired: OrderedDict[SequenceKey, None] = OrderedDict()
        self._executing = 0
        self._stopping = False
        self._closed = False
        self._hang_ns = int(hang_timeout_s * 1e9)
        self._factory = factory
        self._running: dict[int, tuple[Batch, int]] = {}  # instance -> (batch, start)
        self._generation = [0] * len(self._instances)  # bumped when an instance is declared hung
        self._out_of_service: set[int] = set()  # hung instances that could not be replaced
        self.replaced = 0

    def _worker(self, index: int, generation: int) -> None:
        raise NotImplementedError

    def _release(self, seq: Sequence) -> None:
        raise NotImplementedError

    def start(self) -> None:
        with self._lock:
            if self._workers or self._closed:
                return
            self._workers = [self._make_worker(i, 0) for i in range(len(self._instances))]
            reaper = threading.Thread(target=self._reaper, daemon=True, name=f"{self._thread_name()}-reaper")
            self._helpers.append(reaper)
            threads = [*self._workers, reaper]
        for thread in threads:
            thread.start()

    def _thread_name(self) -> str:
        return f"edgeserve-{self.model_name}-v{self.version}"

    def _make_worker(self, index: int, generation: int) -> threading.Thread:
        suffix = f".{generation}" if generation else ""
        name = f"{self._thread_name()}-seq{index}{suffix}"
        return threading.Thread(target=self._worker, args=(index, generation), daemon=True, name=name)

    # -- answering ---------------------------------------------------------------------------------------
    def _claim(self, jobs: list[Job]) -> list[Job]:  # lock held
        """The jobs not answered yet, marked answered (each is answered exactly once)."""
        live = [job for job in jobs if not job.finished]
        for job in live:
            job.finished = True
        return live

    def _answer(self, job: Job, result: Arrays | BaseException) -> None:
        answer(job, result, self.model_name, self.version)

    def _fail(self, jobs: list[Job], error: InferenceError, reason: str) -> None:
        now = time.monotonic_ns()
        for job in jobs:
            self.stats.record_fail(now - job.arrival_ns, reason)
            self._answer(job, error)

    # -- the reaper: idle sequences and hung instances ---------------------------------------------------
    def _reaper(self) -> None:
        periods = [self.spec.idle_ns / 4e9] + ([self._hang_ns / 4e9] if self._hang_ns else [])
        period = min(max(min(periods), 0.005), 0.5)
        while True:
            with self._lock:
                if self._stopping:
                    return
                self._reaper_wake.wait(period)
                now = time.monotonic_ns()
                self.reap(now)
            self.check_hung(now)

    def check_hung(self, now_ns: int) -> None:
        """Answer the batches running longer than hang_timeout_s at `now_ns` and replace (or take out of
        service) their instances: the reaper's check, with the clock a caller (a test) wants."""
        with self._lock:
            hung = self._find_hung(now_ns)
        for index, jobs in hung:
            self._fail_hung(index, jobs)

    def reap(self, now_ns: int) -> int:  # lock held
        """Free the places of sequences idle longer than the timeout; returns how many."""
        limit = self.spec.idle_ns
        idle = [
            s for s in self._sequences.values()
            if s.slot is not None and not s.busy and not s.pending and now_ns - s.last_ns >= limit
        ]  # fmt: skip
        for seq in idle:
            log.info("%s: sequence %s idle for over %d us; its slot is released",
                     self.model_name, seq.key[1], limit // 1000)  # fmt: skip
            self._release(seq)
            self._expired[seq.key] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return len(idle)

    def _drop(self, sequences: list[Sequence]) -> list[Job]:  # lock held
        """Release `sequences` (their state is lost); their queued jobs, to be failed."""
        jobs: list[Job] = []
        for seq in sequences:
            seq.busy = False
            jobs.extend(step.job for step in seq.pending)
            self._pending -= len(seq.pending)
            seq.pending.clear()
            self._release(seq)
        return jobs

    def _find_hung(self, now_ns: int) -> list[tuple[int, list[Job]]]:  # lock held
        found: list[tuple[int, list[Job]]] = []
        for index, (batch, start_ns) in list(self._running.items()):
            if not self._hang_ns or now_ns - start_ns < self._hang_ns:
                continue
            del self._running[index]
            self._generation[index] += 1
            self._executing -= 1
            jobs = [step.job for _, _, step in batch] + self._drop([seq for _, seq, _ in batch])
            if self._factory is None:
                jobs += self._out_of_service_locked(index)
            found.append((index, self._claim(jobs)))
        if found and self._is_idle():
            self._idle.notify_all()
        return found

    def _out_of_service_locked(self, index: int) -> list[Job]:
        self._out_of_service.add(index)
        bound = [seq for seq in self._slots[index] if seq is not None] if not self.spec.oldest else []
        return self._drop(bound)

    def _fail_hung(self, index: int, jobs: list[Job]) -> None:
        seconds = self._hang_ns / 1e9
        fate = "it is being replaced" if self._factory is not None else "it is out of service"
        what = f"{self.model_name} version {self.version}: instance {index}"
        message = f"{what} did not answer in {seconds:g} s; {fate}; its sequences must start again"
        log.error("%s", message)
        self._fail(jobs, InferenceError(Status.UNAVAILABLE, message), "BACKEND")
        if self._factory is not None:
            helper = threading.Thread(target=self._replace, args=(index,), daemon=True,
                                      name=f"{self._thread_name()}-replace{index}")  # fmt: skip
            with self._lock:
                self._helpers = [t for t in self._helpers if t.is_alive()] + [helper]
            helper.start()

    def _replace(self, index: int) -> None:
        """Load a fresh instance for the hung one at `index` and start its worker."""
        assert self._factory is not None
        instance = load_replacement(self._factory, self.model_name, self.version, index, log)
        with self._lock:
            keep = instance is not None and not self._closed and not self._stopping
            if keep and instance is not None:
                self._instances[index] = instance
                worker = self._make_worker(index, self._generation[index])
                self._workers[index] = worker
                self.replaced += 1
                worker.start()
                failed: list[Job] = []
            else:
                failed = self._claim(self._out_of_service_locked(index))
        if failed:
            error = InferenceError(
                Status.UNAVAILABLE, f"{self.model_name}: instance {index} is out of service"
            )
            self._fail(failed, error, "BACKEND")
        if instance is not None and not keep:
            with contextlib.suppress(Exception):
                instance.close()

    # -- drain and close ---------------------------------------------------------------------------------
    def _is_idle(self) -> bool:  # lock held
        return self._pending == 0 and self._executing == 0

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        with self._lock:
            return bool(self._idle.wait_for(self._is_idle, timeout_s))

    async def drain(self, timeout_s: float) -> bool:
        """Stop accepting; let queued requests finish (up to `timeout_s`), then stop the workers."""
        with self._lock:
            self._accepting = False
            # No new requests: sequences with nothing queued give their places to the backlog now.
            for seq in [s for s in self._sequences.values() if s.slot and not s.pending and not s.busy]:
                self._release(seq)
            self._work.notify_all()
        if not self._workers:
            self.start()
        loop = asyncio.get_running_loop()
        idle = await loop.run_in_executor(None, self.wait_idle, timeout_s)
        if idle:
            self._stop()
            await loop.run_in_executor(None, self._join, 5.0)
        return idle

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._reaper_wake.notify_all()

    def _join(self, timeout_s: float) -> list[threading.Thread]:
        """Join every thread (up to `timeout_s` in all); the ones still alive."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = [*self._workers, *self._helpers]
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in threads if t.is_alive() and t is not threading.current_thread()]

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Fail queued requests (UNAVAILABLE), stop the threads, close the instances."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._accepting = False
            leftover = self._claim([step.job for seq in self._sequences.values() for step in seq.pending])
            for seq in self._sequences.values():
                seq.pending.clear()
            self._pending = 0
            self._sequences.clear()
            self._backlog.clear()
            self._idle.notify_all()
        message = f"model '{self.model_name}' version {self.version} is not available (unloading)"
        self._fail(leftover, InferenceError(Status.UNAVAILABLE, message), "OTHER")
        self._stop()
        alive = self._join(join_timeout_s)
        for index, instance in enumerate(self._instances):
            if index < len(self._workers) and self._workers[index] in alive:
                log.warning("%s version %d: instance %d still busy; not closing it",
                            self.model_name, self.version, index)  # fmt: skip
                continue
            try:
                instance.close()
            except Exception:
                log.exception(
                    "%s version %d: closing instance %d failed", self.model_name, self.version, index
                )
