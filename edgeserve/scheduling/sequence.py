"""Triton's sequence batcher for stateful models (`sequence_batching` in config.pbtxt).

Every request names its sequence (`sequence_id`, uint64 or string) with `sequence_start` /
`sequence_end` flags. A sequence holds a place from its START until its END, or until it has been
idle for `max_sequence_idle_microseconds` (the reaper thread frees it; its next request without
START then fails with Triton's START message). A sequence runs at most one request at a time, in
arrival order, so its implicit state (`state [...]`: the previous output fed back as the next input,
zeros or `initial_state` at START) is always the one its previous request produced.

Direct (the default): each sequence is bound to a batch slot (row) of one instance; a batch is the
instance's slots up to the highest one that has a request, empty slots padded with READY=0 rows.
Oldest: sequences hold one of `max_candidate_sequences` places; an idle instance takes the heads of
the oldest sequences that have a request (up to max_batch_size rows, waiting up to
`max_queue_delay_microseconds` for `preferred_batch_size`), compacted, with no empty rows.

More sequences than places wait in a bounded backlog (in START order) and take a place as one frees;
past the backlog a new sequence gets UNAVAILABLE. A sequence queues at most MAX_STEPS_PER_SEQUENCE
requests. Not covered here: request timeouts while queued and the hung-instance watchdog of the
stateless scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Arrays, Job
from edgeserve.scheduling.sequence_config import SequenceKey, SequenceSpec, parse, sequence_flags
from edgeserve.scheduling.sequence_run import Row, Sequence, Step, run_batch
from edgeserve.scheduling.stats import JobTiming, ModelStats

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.sequence")

MAX_STEPS_PER_SEQUENCE = 64
BACKLOG_FACTOR = 4  # backlog bound: this many sequences per place (at least MIN_BACKLOG)
MIN_BACKLOG = 64
_EXPIRED_MEMORY = 1024  # IDs of sequences freed by the idle timeout, for a clearer error


def _shape_key(job: Job) -> tuple[Any, ...]:
    return tuple(sorted((name, a.dtype.str, a.shape) for name, a in job.inputs.items()))


class SequenceBatcher:
    """A model version's scheduler when its config has `sequence_batching` (the data plane's
    SchedulerLike, plus the lifecycle the repository uses: start, drain, close)."""

    def __init__(self, model_name: str, version: int, config: Any, instances: list[Instance],
                 stats: ModelStats, *, model_dir: Path | None = None,
                 max_backlog: int = 0) -> None:  # fmt: skip
        if not instances:
            raise InferenceError(Status.INTERNAL, f"model '{model_name}' version {version} has no instances")
        self.model_name = model_name
        self.version = int(version)
        self.config = config
        self.stats = stats
        self.spec: SequenceSpec = parse(config, f"model '{model_name}'", model_dir)
        self._instances = list(instances)
        rows = self.spec.max_rows
        self._slots: list[list[Sequence | None]] = [[None] * rows for _ in instances]
        self._places = self.spec.max_candidates or rows * len(instances)  # Oldest
        capacity = self._places if self.spec.oldest else rows * len(instances)
        self.max_backlog = max_backlog or max(MIN_BACKLOG, BACKLOG_FACTOR * capacity)
        self._sequences: dict[SequenceKey, Sequence] = {}  # holding a place or in the backlog
        self._backlog: deque[Sequence] = deque()
        self._expired: OrderedDict[SequenceKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._reaper_wake = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._executing = 0
        self._pending = 0
        self._accepting = True
        self._stopping = False
        self._closed = False
        self.compute_ewma_ns = 0
        self.replaced = 0

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            name = f"edgeserve-{self.model_name}-v{self.version}"
            for index in range(len(self._instances)):
                self._threads.append(threading.Thread(target=self._worker, args=(index,), daemon=True,
                                                      name=f"{name}-seq{index}"))  # fmt: skip
            self._threads.append(threading.Thread(target=self._reaper, daemon=True, name=f"{name}-reaper"))
            threads = list(self._threads)
        for thread in threads:
            thread.start()

    @property
    def pending_count(self) -> int:
        return self._pending

    @property
    def batching(self) -> bool:
        return self.spec.batching

    @property
    def instance_count(self) -> int:
        return len(self._instances)

    @property
    def soft_queue_cap(self) -> int:
        return self.max_backlog

    @property
    def active_sequences(self) -> int:
        with self._lock:
            return self._active_count()

    def _active_count(self) -> int:  # lock held
        return sum(1 for s in self._sequences.values() if s.slot is not None)

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool:
        return False  # a sequence's order and state go through the batcher

    # -- requests ----------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job` on its sequence; raises InferenceError (recorded as a failure) when it cannot."""
        try:
            with self._lock:
                self._enqueue(job)
        except InferenceError as exc:
            reason = "REJECTED" if exc.status is Status.UNAVAILABLE else "OTHER"
            self.stats.record_fail(time.monotonic_ns() - job.arrival_ns, reason)
            raise

    def _enqueue(self, job: Job) -> None:  # lock held
        key, start, end = sequence_flags(job.parameters, self.model_name)
        if self.spec.batching and job.batch_size != 1:
            message = f"a sequence request must have batch size 1, got {job.batch_size}"
            raise InferenceError(
                Status.INVALID_ARG, f"inference request to model '{self.model_name}': {message}"
            )
        if not self._accepting:
            raise InferenceError(Status.UNAVAILABLE, f"model '{self.model_name}' version {self.version} is "
                                 "not available (unloading)")  # fmt: skip
        seq = self._sequences.get(key)
        if not start and (seq is None or seq.ended):
            message = (f"inference request for sequence {key[1]} to model '{self.model_name}' must specify "
                       "the START flag on the first request of the sequence")  # fmt: skip
            if key in self._expired:
                message += (f" (it was idle longer than max_sequence_idle_microseconds, "
                            f"{self.spec.idle_ns // 1000} us, and its slot was released)")  # fmt: skip
            raise InferenceError(Status.INVALID_ARG, message)
        now = time.monotonic_ns()
        if seq is None:
            seq = Sequence(key, last_ns=now)
            if not self._place(seq):
                if len(self._backlog) >= self.max_backlog:
                    waiting = len(self._backlog)
                    message = f"every sequence slot is taken and {waiting} sequences wait; retry later"
                    raise InferenceError(Status.UNAVAILABLE, f"model '{self.model_name}': {message}")
                self._backlog.append(seq)
            self._sequences[key] = seq
            self._expired.pop(key, None)
        if len(seq.pending) >= MAX_STEPS_PER_SEQUENCE:
            raise InferenceError(Status.UNAVAILABLE, f"sequence {key[1]} to model '{self.model_name}' has "
                                 f"{len(seq.pending)} requests queued; wait for their answers")  # fmt: skip
        job.enqueue_ns = now
        seq.pending.append(Step(job, start, end))
        seq.ended = end
        seq.last_ns = now
        self._pending += 1
        self._work.notify_all()

    def _place(self, seq: Sequence) -> bool:  # lock held
        if self.spec.oldest:
            if self._active_count() >= self._places:
                return False
            seq.slot = (-1, -1)
            return True
        best: tuple[int, int] | None = None
        best_used = 0
        for index, slots in enumerate(self._slots):
            used = sum(1 for s in slots if s is not None)
            if used < len(slots) and (best is None or used < best_used):
                best, best_used = (index, slots.index(None)), used
        if best is None:
            return False
        self._slots[best[0]][best[1]] = seq
        seq.slot = best
        return True

    def _release(self, seq: Sequence) -> None:  # lock held
        if self._sequences.get(seq.key) is seq:
            del self._sequences[seq.key]
        if seq.slot is not None and seq.slot[0] >= 0:
            self._slots[seq.slot[0]][seq.slot[1]] = None
        seq.slot = None
        while self._backlog and self._place(self._backlog[0]):
            self._backlog.popleft()
        self._work.notify_all()

    # -- workers -----------------------------------------------------------------------------------------
    def _worker(self, index: int) -> None:
        instance = self._instances[index]
        while True:
            batch = self._next_batch(index)
            if batch is None:
                return
            try:
                self._execute(instance, batch)
            except BaseException:  # a bug here must not leave the counts wrong
                log.exception("%s version %d: sequence worker failed", self.model_name, self.version)
            finally:
                self._after(batch)

    def _next_batch(self, index: int) -> list[tuple[int, Sequence, Step]] | None:
        with self._lock:
            while True:
                if self.spec.oldest:
                    ready = [s for s in self._sequences.values() if s.slot and s.pending and not s.busy]
                    ready.sort(key=lambda s: s.pending[0].job.enqueue_ns)
                else:
                    ready = [s for s in self._slots[index] if s is not None and s.pending and not s.busy]
                if ready:
                    shape = _shape_key(ready[0].pending[0].job)
                    chosen = [s for s in ready if _shape_key(s.pending[0].job) == shape][: self.spec.max_rows]
                    wait_ns = self._batch_delay(chosen)
                    if wait_ns <= 0:
                        return self._take(chosen)
                    self._work.wait(wait_ns / 1e9)
                    continue
                if self._stopping:
                    return None
                self._work.wait()

    def _batch_delay(self, chosen: list[Sequence]) -> int:  # lock held
        spec = self.spec
        if not spec.delay_ns or not self._accepting or len(chosen) >= spec.preferred_rows:
            return 0
        return min(s.pending[0].job.enqueue_ns for s in chosen) + spec.delay_ns - time.monotonic_ns()

    def _take(self, chosen: list[Sequence]) -> list[tuple[int, Sequence, Step]]:  # lock held
        batch: list[tuple[int, Sequence, Step]] = []
        for position, seq in enumerate(chosen):
            step = seq.pending.popleft()
            seq.busy = True
            row = seq.slot[1] if seq.slot is not None and not self.spec.oldest else position
            batch.append((row, seq, step))
        self._pending -= len(batch)
        self._executing += 1
        return sorted(batch, key=lambda item: item[0])

    def _execute(self, instance: Instance, batch: list[tuple[int, Sequence, Step]]) -> None:
        taken_ns = time.monotonic_ns()
        rows = [Row(row, seq.key, step.start, step.end, step.job.inputs, None if step.start else seq.state)
                for row, seq, step in batch]  # fmt: skip
        try:
            results, states, timing = run_batch(self.spec, instance, rows)
        except BaseException as exc:
            error = exc if isinstance(exc, InferenceError) else InferenceError(Status.INTERNAL, str(exc))
            prefix = f"{self.model_name} version {self.version}: "
            if not error.message.startswith(prefix):
                error = InferenceError(error.status, prefix + error.message)
            now = time.monotonic_ns()
            for _, _, step in batch:
                self.stats.record_fail(now - step.job.arrival_ns, "BACKEND")
                self._deliver(step.job, error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, seq, _), state in zip(batch, states, strict=True):
            seq.state = state
        timings: list[JobTiming] = []
        for (_, _, step), result in zip(batch, results, strict=True):
            self._deliver(step.job, result)
            end = time.monotonic_ns()
            timings.append(
                JobTiming(end - step.job.arrival_ns, taken_ns - step.job.enqueue_ns, end - timing[2])
            )
        self.compute_ewma_ns = timing[2] - timing[1]
        self.stats.record_execution(len(batch), timing[1] - taken_ns, timing[2] - timing[1],
                                    time.monotonic_ns() - timing[2], timings)  # fmt: skip

    def _deliver(self, job: Job, result: Arrays | BaseException) -> None:
        if job.finished:
            return
        job.finished = True
        try:
            job.done(result)
        except Exception:
            log.exception("%s version %d: the result callback of request '%s' failed",
                          self.model_name, self.version, job.request_id)  # fmt: skip

    def _after(self, batch: list[tuple[int, Sequence, Step]]) -> None:
        with self._lock:
            now = time.monotonic_ns()
            for _, seq, step in batch:
                seq.busy = False
                seq.last_ns = now
                if step.end and not seq.pending:
                    self._release(seq)
            self._executing -= 1
            self._work.notify_all()
            if self._is_idle():
                self._idle.notify_all()

    # -- idle timeout ------------------------------------------------------------------------------------
    def _reaper(self) -> None:
        period = min(max(self.spec.idle_ns / 4e9, 0.005), 0.5)
        with self._lock:
            while not self._stopping:
                self._reaper_wake.wait(period)
                self.reap(time.monotonic_ns())

    def reap(self, now_ns: int) -> int:  # lock held (or a test)
        """Free the places of sequences idle longer than the timeout; returns how many."""
        limit = self.spec.idle_ns
        idle = [
            s for s in self._sequences.values()
            if s.slot is not None and not s.busy and not s.pending and now_ns - s.last_ns >= limit
        ]  # fmt: skip
        for seq in idle:
            log.info("%s: sequence %s idle for over %d us; its slot is released",
                     self.model_name, seq.key[1], self.spec.idle_ns // 1000)  # fmt: skip
            self._release(seq)
            self._expired[seq.key] = None
            if len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        return len(idle)

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
        if not self._threads:
            self.start()
        idle = await asyncio.get_running_loop().run_in_executor(None, self.wait_idle, timeout_s)
        if idle:
            self._stop()
            await asyncio.get_running_loop().run_in_executor(None, self._join, 5.0)
        return idle

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._reaper_wake.notify_all()

    def _join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Fail queued requests (UNAVAILABLE), stop the workers and the reaper, close the instances."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._accepting = False
            leftover = [step for seq in self._sequences.values() for step in seq.pending]
            for seq in self._sequences.values():
                seq.pending.clear()
            self._pending = 0
            self._sequences.clear()
            self._backlog.clear()
        error = InferenceError(Status.UNAVAILABLE, f"model '{self.model_name}' version {self.version} is not "
                               "available (unloading)")  # fmt: skip
        now = time.monotonic_ns()
        for step in leftover:
            self.stats.record_fail(now - step.job.arrival_ns, "OTHER")
            self._deliver(step.job, error)
        self._stop()
        self._join(join_timeout_s)
        for index, instance in enumerate(self._instances):
            try:
                instance.close()
            except Exception:
                log.exception(
                    "%s version %d: closing instance %d failed", self.model_name, self.version, index
                )
