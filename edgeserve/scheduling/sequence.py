"""Triton's sequence batcher for stateful models (`sequence_batching` in config.pbtxt).

Every request names its sequence (`sequence_id`, uint64 or string) with `sequence_start` /
`sequence_end` flags. A sequence holds a place from its START until its END, or until it has been
idle for `max_sequence_idle_microseconds` (the reaper thread frees it; its next request without
START then fails with Triton's START message). A sequence runs at most one request at a time, in
arrival order, so its implicit state (`state [...]`: the previous output fed back as the next input,
zeros or `initial_state` at START) is always the one its previous request produced.

Direct (the default): each sequence is bound to a batch slot (row) of one instance; a batch is the
instance's slots up to the highest one that has a request, empty slots padded with READY=0 rows.
An instance that takes separate requests (Python models) gets one request per slot instead, the
empty slots as null requests (sequence_run.py), so each request holds one sequence's row.
Oldest: sequences hold one of `max_candidate_sequences` places; an idle instance takes the heads of
the oldest sequences that have a request (up to max_batch_size rows, waiting up to
`max_queue_delay_microseconds` for `preferred_batch_size`), compacted, with no empty rows.

More sequences than places wait in a bounded backlog (in START order) and take a place as one frees;
past the backlog a new sequence gets UNAVAILABLE. A sequence queues at most MAX_STEPS_PER_SEQUENCE
requests. A batch running past the hang timeout is answered UNAVAILABLE, its sequences must START
again and its instance is replaced (sequence_life.py). Request timeouts do not apply while queued
(as in Triton, where they belong to the dynamic batcher).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.backends.options import DEFAULT_HANG_TIMEOUT_S
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.sequence_config import SequenceKey, SequenceSpec, parse, sequence_flags
from edgeserve.scheduling.sequence_life import Batch, InstanceFactory, SequenceLifecycle
from edgeserve.scheduling.sequence_run import Row, Sequence, Step, run_batch
from edgeserve.scheduling.stats import JobTiming, ModelStats
from edgeserve.scheduling.versioned import ModelVersionScheduler

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.sequence")

MAX_STEPS_PER_SEQUENCE = 64
BACKLOG_FACTOR = 4  # backlog bound: this many sequences per place (at least MIN_BACKLOG)
MIN_BACKLOG = 64


def _shape_key(job: Job) -> tuple[Any, ...]:
    return tuple(sorted((name, a.dtype.str, a.shape) for name, a in job.inputs.items()))


class SequenceBatcher(ModelVersionScheduler, SequenceLifecycle):
    """A model version's scheduler when its config has `sequence_batching` (the data plane's
    SchedulerLike, plus the lifecycle the repository uses: start, drain, close)."""

    def __init__(self, model_name: str, version: int, config: Any, instances: list[Instance],
                 stats: ModelStats, *, model_dir: Path | None = None, max_backlog: int = 0,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 instance_factory: InstanceFactory | None = None) -> None:  # fmt: skip
        self._init_version(model_name, version, config, instances, stats)
        self.spec: SequenceSpec = parse(config, f"model '{model_name}'", model_dir)
        rows = self.spec.max_rows
        self._slots: list[list[Sequence | None]] = [[None] * rows for _ in instances]
        self._places = self.spec.max_candidates or rows * len(instances)  # Oldest
        capacity = self._places if self.spec.oldest else rows * len(instances)
        self.max_backlog = max_backlog or max(MIN_BACKLOG, BACKLOG_FACTOR * capacity)
        self._sequences: dict[SequenceKey, Sequence] = {}  # holding a place or in the backlog
        self._backlog: deque[Sequence] = deque()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._pending = 0
        self._accepting = True
        self.compute_ewma_ns = 0
        self._init_lifecycle(hang_timeout_s, instance_factory)

    @property
    def pending_count(self) -> int:
        return self._pending

    @property
    def batching(self) -> bool:
        return self.spec.batching

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
            if index in self._out_of_service:
                continue
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
    def _worker(self, index: int, generation: int) -> None:
        instance = self._instances[index]
        while True:
            batch = self._next_batch(index, generation)
            if batch is None:
                return
            try:
                self._execute(instance, batch, index, generation)
            except BaseException:  # a bug here must not leave the counts wrong
                log.exception("%s version %d: sequence worker failed", self.model_name, self.version)
            finally:
                current = self._after(batch, index, generation)
            if not current:  # declared hung and replaced while it ran
                log.warning("%s version %d: hung instance %d answered at last; closing it",
                            self.model_name, self.version, index)  # fmt: skip
                try:
                    instance.close()
                except Exception:
                    log.exception("%s: closing a hung instance failed", self.model_name)
                return

    def _next_batch(self, index: int, generation: int) -> Batch | None:
        with self._lock:
            while True:
                if self._generation[index] != generation:
                    return None
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
                        return self._take(chosen, index)
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

    def _take(self, chosen: list[Sequence], index: int) -> Batch:  # lock held
        batch: Batch = []
        for position, seq in enumerate(chosen):
            step = seq.pending.popleft()
            seq.busy = True
            row = seq.slot[1] if seq.slot is not None and not self.spec.oldest else position
            batch.append((row, seq, step))
        batch.sort(key=lambda item: item[0])
        self._pending -= len(batch)
        self._executing += 1
        self._running[index] = (batch, time.monotonic_ns())
        return batch

    def _execute(self, instance: Instance, batch: Batch, index: int, generation: int) -> None:
        taken_ns = time.monotonic_ns()
        rows = [Row(row, seq.key, step.start, step.end, step.job.inputs, None if step.start else seq.state,
                    step.job.request_id, step.job.parameters) for row, seq, step in batch]  # fmt: skip
        try:
            results, states, timing = run_batch(self.spec, instance, rows)
        except BaseException as exc:
            error = self._prefixed(
                exc if isinstance(exc, InferenceError) else InferenceError(Status.INTERNAL, str(exc))
            )
            with self._lock:
                failed = self._claim([step.job for _, _, step in batch])
            self._fail(failed, error, "BACKEND")
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            if self._generation[index] == generation:  # else: answered and released as hung
                for (_, seq, step), state in zip(batch, states, strict=True):
                    if state is not None:
                        seq.state = state
                    elif step.start:  # a failed START: the old sequence's state must not carry on
                        seq.state = None
            live = {id(job) for job in self._claim([step.job for _, _, step in batch])}
        timings: list[JobTiming] = []
        for (_, _, step), result in zip(batch, results, strict=True):
            if id(step.job) not in live:
                continue
            if isinstance(result, InferenceError):  # this request's own error (a per-request model)
                self.stats.record_fail(time.monotonic_ns() - step.job.arrival_ns, "BACKEND")
                self._answer(step.job, self._prefixed(result))
                continue
            self._answer(step.job, result)
            end = time.monotonic_ns()
            timings.append(
                JobTiming(end - step.job.arrival_ns, taken_ns - step.job.enqueue_ns, end - timing[2])
            )
        self.compute_ewma_ns = timing[2] - timing[1]
        self.stats.record_execution(len(batch), timing[1] - taken_ns, timing[2] - timing[1],
                                    time.monotonic_ns() - timing[2], timings)  # fmt: skip

    def _prefixed(self, error: InferenceError) -> InferenceError:
        prefix = f"{self.model_name} version {self.version}: "
        return (
            error
            if error.message.startswith(prefix)
            else InferenceError(error.status, prefix + error.message)
        )

    def _after(self, batch: Batch, index: int, generation: int) -> bool:
        """False when the instance was declared hung meanwhile (the reaper settled the counts)."""
        with self._lock:
            if self._generation[index] != generation:
                return False
            self._running.pop(index, None)
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
            return True
