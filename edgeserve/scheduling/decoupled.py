"""Decoupled models in the stateless scheduler (scheduler.py): Triton's
`model_transaction_policy { decoupled: true }`.

A batch runs through `StreamingInstance.infer_decoupled` with one `JobSink` per job. The instance is
free for the next batch when that returns; each job stays live until its model sends the final flag
(or its requester cancels, or its deadline passes: `_check_streams`, from the watchdog). Each
response goes to `Job.on_response` in the order the model sent it; the job is claimed (answered once)
at its final response, so a timeout or a cancel racing the model ends it exactly once, and whatever
the model sends afterwards is dropped without reaching anyone (`JobSink.cancelled` tells the model).

Statistics: the batch (execution count, compute) when `infer_decoupled` returns; each request at its
final response (success or failure); each response in `ModelStats.record_response`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from edgeserve.backends.base import Array, RequestInfo
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.queue import TIMEOUT_MESSAGE

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance
    from edgeserve.scheduling.stats import ModelStats

log = logging.getLogger("edgeserve.scheduler")

AFTER_FINAL_MESSAGE = "a response was sent after the final flag of request '{id}'; dropped"


class JobSink:
    """The ResponseSink (backends/streams.py) of one job of a decoupled batch."""

    __slots__ = ("_final", "_lock", "_owner", "job", "responses")

    def __init__(self, owner: DecoupledRuns, job: Job) -> None:
        self._owner = owner
        self.job = job
        self._lock = threading.Lock()  # one response at a time, in the order sent
        self._final = False
        self.responses = 0

    @property
    def cancelled(self) -> bool:
        job = self.job
        return job.cancelled or (job.finished and not self._final)

    def send(
        self, outputs: Mapping[str, Array] | None, *, final: bool = False, error: InferenceError | None = None
    ) -> None:
        with self._lock:
            if self._final:
                message = AFTER_FINAL_MESSAGE.format(id=self.job.request_id)
                log.error("%s: %s", self._owner.model_name, message)
                raise InferenceError(Status.INTERNAL, message)
            self._final = final
            job = self.job
            if job.finished or job.cancelled:  # its requester is gone: dropped here, at no cost
                if final:
                    self._owner._forget(job)
                return
            result: dict[str, Array] | InferenceError | None = error
            if error is None and outputs is not None:
                result = dict(outputs)
            index = self.responses
            self.responses += 1
            if final and not self._owner._finish(job, result):
                return  # answered meanwhile (deadline, cancel)
            if result is not None:
                self._owner.stats.record_response(index, error is not None)
            callback = job.on_response
            if callback is None:  # pragma: no cover - a decoupled job always has one (data plane)
                return
            try:
                callback(result, final)
            except Exception:
                log.exception("%s: the response callback of request '%s' failed",
                              self._owner.model_name, job.request_id)  # fmt: skip

    def fail(self, error: InferenceError) -> None:
        """The execute call raised: a final error response, unless the final flag was already sent."""
        with contextlib.suppress(InferenceError):  # its final was sent before execute raised
            self.send(None, final=True, error=error)


class DecoupledRuns:
    """The Scheduler's decoupled runs (a mixin: the state is the Scheduler's)."""

    model_name: str
    version: int
    stats: ModelStats
    _lock: threading.Lock
    _batches: dict[int, tuple[list[Job], int]]
    _live: dict[int, Job]  # id(job) -> job: decoupled jobs whose final response has not come yet
    compute_ewma_ns: int

    def _claim(self, jobs: list[Job]) -> list[Job]:
        raise NotImplementedError

    def _fail(self, jobs: list[Job], error: InferenceError, reason: str, *, claim: bool = True) -> None:
        raise NotImplementedError

    def _backend_error(self, exc: BaseException) -> InferenceError:
        raise NotImplementedError

    def _measure(self, spent_ns: int, jobs: int) -> None:
        raise NotImplementedError

    def _execute_decoupled(self, instance: Instance, jobs: list[Job], taken_ns: int, index: int) -> None:
        rows = sum(job.batch_size for job in jobs)
        entry = (jobs, taken_ns)
        sinks = [JobSink(self, job) for job in jobs]
        with self._lock:
            for job in jobs:
                self._live[id(job)] = job
            self._batches[index] = entry  # the hang watchdog covers the execute call itself
        infos = [RequestInfo(job.request_id, parameters=job.parameters) for job in jobs]
        run: Any = getattr(instance, "infer_decoupled", None)
        start = time.monotonic_ns()
        try:
            if run is None:
                raise InferenceError(Status.INTERNAL, "the backend of this model cannot stream responses "
                                     "(model_transaction_policy.decoupled)")  # fmt: skip
            run([job.inputs for job in jobs], infos, sinks)
        except BaseException as exc:
            self._unbatch(index, entry)
            error = self._backend_error(exc)
            for sink in sinks:
                sink.fail(error)
            if not isinstance(exc, Exception):
                raise
            return
        end = time.monotonic_ns()
        self._unbatch(index, entry)
        spent = end - start
        ewma = self.compute_ewma_ns
        self.compute_ewma_ns = spent if ewma == 0 else ewma + (spent - ewma) // 8
        self._measure(spent, len(jobs))
        self.stats.record_batch(rows, start - taken_ns, spent, 0)

    def _unbatch(self, index: int, entry: tuple[list[Job], int]) -> None:
        with self._lock:
            if self._batches.get(index) is entry:
                del self._batches[index]

    def _finish(self, job: Job, result: dict[str, Array] | InferenceError | None) -> bool:
        """Claim `job` at its final response and record it; False when it was answered already."""
        with self._lock:
            self._live.pop(id(job), None)
            if not self._claim([job]):
                return False
        duration = time.monotonic_ns() - job.arrival_ns
        if isinstance(result, InferenceError):
            self.stats.record_fail(duration, "BACKEND")
        else:
            self.stats.record_success(duration, 0, 0, 0, 0)
        return True

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._live.pop(id(job), None)

    def _end_live(self, jobs: list[Job]) -> list[Job]:  # lock held
        """Of `jobs`, the live decoupled ones, taken out and claimed (their requester cancelled)."""
        live = [self._live.pop(id(job)) for job in jobs if id(job) in self._live]
        return self._claim(live)

    def _end_all_live(self) -> list[Job]:  # lock held: close()
        live = list(self._live.values())
        self._live.clear()
        return self._claim(live)

    def _check_streams(self, now_ns: int) -> None:
        """Watchdog: a live decoupled job past its deadline ends with the timeout error; the model
        sees it cancelled."""
        if not self._live:
            return
        with self._lock:
            late = [job for job in self._live.values() if job.deadline_ns and job.deadline_ns <= now_ns]
            for job in late:
                del self._live[id(job)]
            late = self._claim(late)
        if late:
            self._fail(late, InferenceError(Status.UNAVAILABLE, TIMEOUT_MESSAGE), "REJECTED", claim=False)

    @property
    def live_streams(self) -> int:
        """Decoupled requests whose final response has not come yet."""
        return len(self._live)
