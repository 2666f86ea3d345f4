"""Inline runs of the stateless scheduler (scheduler.py): a job run on the submitting thread.

A frontend may run a job itself with `try_run_inline` (the ZeroMQ thread for models up to
milliseconds, the event loop for HTTP and gRPC up to tens of µs) when the queue is empty, an
instance is idle and the model's recent compute time is short: when it batches with a window, the
window is short (<= 1 ms: it only catches requests arriving together) and the run is shorter still,
so the job is answered before that batch would have started; a longer window is respected. That
saves the hand-offs to the worker thread and back, the largest single cost of a small model's round
trip on a 2-vCPU box. The instance is claimed for the run, so its worker leaves the queue to the
other workers until the claim ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from edgeserve.scheduling.job import Job
from edgeserve.scheduling.queue import JobQueue

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance

# The longest batching window an inline run may skip.
INLINE_WINDOW_MAX_NS = 1_000_000


class InlineRuns:
    """The Scheduler's inline runs (a mixin: the state is the Scheduler's)."""

    _lock: threading.Lock
    _work: threading.Condition
    _queue: JobQueue
    _instances: list[Instance]
    _threads: list[threading.Thread]
    _generation: list[int]
    _claimed: set[int]
    _running: set[int]
    _replacing: set[int]
    _executing: int
    _accepting: bool
    _delay_ns: int
    compute_ewma_ns: int
    inline_runs: int
    decoupled: bool

    def _execute(self, instance: Instance, jobs: list[Job], taken_ns: int, index: int) -> None:
        raise NotImplementedError

    def _is_idle(self) -> bool:
        raise NotImplementedError

    def _notify_idle(self) -> None:
        raise NotImplementedError

    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool:
        """Run `job` on the calling thread if nothing is queued, an instance is idle, and the model's
        recent compute time is under `max_compute_ns` (the caller is blocked that long) and, if it
        batches with a window, under that window of at most INLINE_WINDOW_MAX_NS. False: nothing
        happened, `submit` it instead."""
        if self.decoupled:  # its sends may wait on a slow reader: never on a frontend's thread
            return False
        ewma = self.compute_ewma_ns
        limit = max_compute_ns
        if self._delay_ns:
            # A short window only catches requests that arrive together: a run that ends before it
            # would expire answers sooner than that batch could. A long one trades latency for batch
            # size on purpose (Triton's contract): respected.
            if self._delay_ns > INLINE_WINDOW_MAX_NS:
                return False
            limit = min(limit, self._delay_ns)
        if not 0 < ewma <= limit:
            return False
        with self._lock:
            if not self._accepting or self._queue or not self._threads:
                return False
            index = self._idle_instance()
            if index < 0:
                return False
            self._claimed.add(index)
            self._executing += 1
            self.inline_runs += 1
            generation = self._generation[index]
            instance = self._instances[index]
        now = time.monotonic_ns()
        job.enqueue_ns = now
        try:
            self._execute(instance, [job], now, index)
        finally:
            self._end_inline(index, generation, instance)
        return True

    def _idle_instance(self) -> int:  # lock held; -1 = none
        running, claimed, replacing = self._running, self._claimed, self._replacing
        for index in range(len(self._instances)):
            if index not in running and index not in claimed and index not in replacing:
                return index
        return -1

    def _end_inline(self, index: int, generation: int, instance: Instance) -> None:
        with self._lock:
            if self._generation[index] != generation:
                replaced = True  # declared hung while it ran here: the watchdog settled the counts
            else:
                replaced = False
                self._claimed.discard(index)
                self._executing -= 1
                if self._queue:  # queued meanwhile: this instance's worker may be the one to take it
                    self._work.notify_all()
                elif self._is_idle():
                    self._notify_idle()
        if replaced:
            with contextlib.suppress(Exception):
                instance.close()
