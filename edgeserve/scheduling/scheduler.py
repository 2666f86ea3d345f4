"""One model version's scheduler: a shared priority queue, a dynamic batcher and one worker thread
per backend instance (runtimes release the GIL while they compute).

A worker takes the queue head and the later jobs whose inputs have the same per-row shapes and
dtypes (`Job.shape_key`), up to `max_batch_size` rows. While that batch is below the largest
preferred batch size (or max_batch_size) it waits up to `max_queue_delay_microseconds`, measured
from the head job's enqueue, for more. Idle workers also wake at the nearest queued deadline, so a
timed-out REJECT job fails promptly.

Copies: a batch of one job hands the job's arrays to the backend as they are; a batch of several
concatenates each input once into the batch buffer. Outputs go back to each job as row views.

Inline runs: a frontend on its own thread (ZeroMQ) may run a job itself with `try_run_inline` when
a worker would do exactly that at once anyway (queue empty, an instance idle, no batching delay)
and the model's recent compute time is short. That saves the hand-off to the worker thread, the
largest single cost of a small model's round trip on a 2-vCPU box. The instance is claimed for the
run, so its worker leaves the queue to the other workers until the claim ends.

Accounting: every request that reaches `submit` ends in exactly one `job.done` call and one stats
record (`record_fail` for rejections here, including the ones `submit` raises; the caller records
only the failures it finds before calling `submit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Arrays, Job
from edgeserve.scheduling.queue import DEFAULT_HARD_QUEUE_CAP, TIMEOUT_MESSAGE, JobQueue
from edgeserve.scheduling.stats import JobTiming, ModelStats

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.scheduler")

_NS_PER_S = 1_000_000_000


def _shape_key(job: Job) -> tuple[Any, ...]:
    """Jobs batch together only when every input has the same dtype and per-row shape."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in job.inputs.items()))


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Scheduler:
    def __init__(self, model_name: str, version: int, config: ModelConfig, instances: list[Instance],
                 stats: ModelStats, *, hard_queue_cap: int = DEFAULT_HARD_QUEUE_CAP) -> None:  # fmt: skip
        if not instances:
            raise InferenceError(Status.INTERNAL, f"model '{model_name}' version {version} has no instances")
        self.model_name = model_name
        self.version = int(version)
        self.config = config
        self.stats = stats
        self._instances = list(instances)
        self._queue = JobQueue.from_config(config, hard_queue_cap)
        self._batching = bool(config.HasField("dynamic_batching") and config.max_batch_size > 0)
        self._max_rows = int(config.max_batch_size) if self._batching else 0
        self._delay_ns = 0
        self._target_rows = self._max_rows
        if self._batching:
            batching = config.dynamic_batching
            self._delay_ns = int(batching.max_queue_delay_microseconds) * 1000
            preferred = [int(p) for p in batching.preferred_batch_size if 0 < int(p) <= self._max_rows]
            if preferred:
                self._target_rows = max(preferred)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for jobs
        self._idle = threading.Condition(self._lock)  # wait_idle waits here
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []  # drain()
        self._threads: list[threading.Thread] = []
        self._executing = 0  # batches taken from the queue (or run inline) and not yet finished
        self._running: set[int] = set()  # instances whose worker executes a batch
        self._claimed: set[int] = set()  # instances running an inline job on a frontend's thread
        self.compute_ewma_ns = 0  # recent compute time per batch; 0 = none measured yet
        self._accepting = True  # False once drain/close began
        self._stopping = False  # workers exit when they find the queue empty
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for index, instance in enumerate(self._instances):
                thread = threading.Thread(
                    target=self._worker, args=(index, instance), daemon=True,
                    name=f"edgeserve-{self.model_name}-v{self.version}-{index}",
                )  # fmt: skip
                self._threads.append(thread)
            threads = list(self._threads)
        for thread in threads:
            thread.start()

    @property
    def pending_count(self) -> int:
        """Jobs queued and not yet executing (Triton's nv_inference_pending_request_count)."""
        return len(self._queue)

    @property
    def batching(self) -> bool:
        return self._batching

    def submit(self, job: Job) -> None:
        """Queue `job`. Raises InferenceError (and records the failure) when it cannot be queued:
        UNAVAILABLE when unloading or when the priority level is full, INVALID_ARG for a bad priority."""
        if self._batching:
            job.shape_key = _shape_key(job)
        with self._lock:
            try:
                if not self._accepting:
                    raise self._unloading()
                level = self._queue.level_of(int(job.priority))
                self._queue.push(job, level, time.monotonic_ns())
            except InferenceError as exc:
                reason = "REJECTED" if exc.status is Status.UNAVAILABLE and self._accepting else "OTHER"
                self.stats.record_fail(time.monotonic_ns() - job.arrival_ns, reason)
                raise
            self._wake_worker()

    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool:
        """Run `job` on the calling thread if nothing is queued, an instance is idle, the model does
        not wait for a batch to fill, and its recent compute time is under `max_compute_ns` (the
        caller is blocked that long). False: nothing happened, `submit` it instead."""
        ewma = self.compute_ewma_ns
        if self._delay_ns or not 0 < ewma <= max_compute_ns:
            return False
        with self._lock:
            if not self._accepting or self._queue or not self._threads:
                return False
            index = next(
                (i for i in range(len(self._instances)) if i not in self._running and i not in self._claimed),
                -1,
            )
            if index < 0:
                return False
            self._claimed.add(index)
            self._executing += 1
        now = time.monotonic_ns()
        job.enqueue_ns = now
        try:
            self._execute(self._instances[index], [job], now)
        finally:
            with self._lock:
                self._claimed.discard(index)
                self._executing -= 1
                if self._queue:  # queued meanwhile: this instance's worker may be the one to take it
                    self._work.notify_all()
                elif self._is_idle():
                    self._notify_idle()
        return True

    def _wake_worker(self) -> None:  # lock held
        # A worker whose instance is claimed goes back to sleep: wake them all so a free one runs.
        if self._claimed:
            self._work.notify_all()
        else:
            self._work.notify()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is empty and no batch is executing (stats of finished jobs are
        recorded by then). False on timeout."""
        with self._lock:
            return bool(self._idle.wait_for(self._is_idle, timeout_s))

    def _is_idle(self) -> bool:  # lock held
        return not self._queue and self._executing == 0

    def _notify_idle(self) -> None:  # lock held, scheduler idle
        self._idle.notify_all()
        waiters, self._idle_waiters = self._idle_waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits any more
                loop.call_soon_threadsafe(_resolve, waiter)

    async def drain(self, timeout_s: float) -> bool:
        """Stop accepting, let every queued job finish, then stop the workers (instances stay open
        until `close`). Returns False when `timeout_s` passed first; `close` then fails the rest.
        Waits on the event loop (no executor thread per draining model)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._accepting = False
            self._work.notify_all()  # waiting batchers flush without their queue delay
            if self._is_idle():
                waiter.set_result(None)
            else:
                self._idle_waiters.append((loop, waiter))
        if not self._threads:
            self.start()  # never started: run what was queued before draining
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            with self._lock:
                self._idle_waiters = [(lp, w) for lp, w in self._idle_waiters if w is not waiter]
            return False
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        # idle workers return as soon as they see `_stopping`; joining takes microseconds
        alive = await loop.run_in_executor(None, self._join, 5.0)
        return not alive

    def close(self, join_timeout_s: float = 30.0) -> None:
        """Fail queued jobs with UNAVAILABLE, stop the workers (a running batch finishes first) and
        close the instances. Blocks while a batch runs; call it off the event loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._accepting = False
            self._stopping = True
            leftover = self._queue.pop_all()
            self._work.notify_all()
            if self._executing == 0:
                self._notify_idle()
        self._fail(leftover, self._unloading(), "OTHER")
        alive = self._join(join_timeout_s)
        with self._lock:  # an inline run still holds its instance
            self._idle.wait_for(lambda: not self._claimed, join_timeout_s)
        for index, instance in enumerate(self._instances):
            if index < len(self._threads) and self._threads[index] in alive:
                log.warning("%s version %d: instance %d still busy after %.0fs; not closing it",
                            self.model_name, self.version, index, join_timeout_s)  # fmt: skip
                continue
            try:
                instance.close()
            except Exception:
                log.exception("%s version %d: closing instance %d failed",
                              self.model_name, self.version, index)  # fmt: skip

    def _unloading(self) -> InferenceError:
        message = f"model '{self.model_name}' version {self.version} is not available (unloading)"
        return InferenceError(Status.UNAVAILABLE, message)

    def _join(self, timeout_s: float) -> list[threading.Thread]:
        deadline = time.monotonic() + timeout_s
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current and thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive() and t is not current]

    # -- workers ----------------------------------------------------------------------------------
    def _worker(self, index: int, instance: Instance) -> None:
        while True:
            jobs, expired, taken_ns = self._next_batch(index)
            if jobs is None:
                return
            try:
                if expired:
                    self._fail(expired, InferenceError(Status.UNAVAILABLE, TIMEOUT_MESSAGE), "REJECTED")
                else:
                    self._execute(instance, jobs, taken_ns)
            except BaseException:  # a bug here must not leave the executing count wrong
                log.exception("%s version %d: worker failed", self.model_name, self.version)
            finally:
                self._after_batch(index)

    def _next_batch(self, index: int) -> tuple[list[Job] | None, list[Job], int]:
        """(jobs to run, expired jobs to fail, time taken); jobs None = exit. Either list counts as
        executing (so `wait_idle` waits for its callbacks) until `_after_batch`."""
        with self._lock:
            while True:
                now = time.monotonic_ns()
                expired = self._queue.expire(now)
                if expired:
                    self._executing += 1
                    return [], expired, now
                if not self._queue or index in self._claimed:
                    if self._stopping and not self._queue:
                        return None, [], now
                    deadline = self._queue.next_deadline_ns
                    self._work.wait((deadline - now) / _NS_PER_S if deadline else None)
                    continue
                jobs, rows, full = self._queue.select(self._max_rows)
                if self._delay_ns and not full and rows < self._target_rows and self._accepting:
                    wake = jobs[0].enqueue_ns + self._delay_ns
                    if now < wake:
                        deadline = self._queue.next_deadline_ns
                        if deadline:
                            wake = min(wake, deadline)
                        self._work.wait((wake - now) / _NS_PER_S)
                        continue
                self._queue.remove(jobs)
                self._executing += 1
                self._running.add(index)
                if self._queue:
                    self._wake_worker()  # another idle worker can take what is left
                return jobs, [], now

    def _after_batch(self, index: int) -> None:
        with self._lock:
            self._executing -= 1
            self._running.discard(index)
            if self._is_idle():
                self._notify_idle()

    def _execute(self, instance: Instance, jobs: list[Job], taken_ns: int) -> None:
        rows = sum(job.batch_size for job in jobs)
        try:
            inputs = self._assemble(jobs)
            infer_start = time.monotonic_ns()
            outputs = instance.infer(inputs)
            infer_end = time.monotonic_ns()
            ewma = self.compute_ewma_ns
            spent = infer_end - infer_start
            self.compute_ewma_ns = spent if ewma == 0 else ewma + (spent - ewma) // 8
            results = self._split(jobs, outputs, rows)
        except BaseException as exc:
            self._fail(jobs, self._backend_error(exc), "BACKEND")
            if not isinstance(exc, Exception):
                raise
            return
        timings: list[JobTiming] = []
        for job, result in zip(jobs, results, strict=True):
            self._deliver(job, result)
            end = time.monotonic_ns()
            timings.append(JobTiming(end - job.arrival_ns, taken_ns - job.enqueue_ns, end - infer_end))
        output_end = time.monotonic_ns()
        self.stats.record_execution(rows, infer_start - taken_ns, infer_end - infer_start,
                                    output_end - infer_end, timings)  # fmt: skip

    @staticmethod
    def _assemble(jobs: list[Job]) -> Arrays:
        if len(jobs) == 1:
            return jobs[0].inputs  # no copy: the request's own views go to the runtime
        names = jobs[0].inputs.keys()
        return {name: np.concatenate([job.inputs[name] for job in jobs], axis=0) for name in names}

    def _split(self, jobs: list[Job], outputs: dict[str, Any], rows: int) -> Sequence[Arrays]:
        if len(jobs) == 1:
            return [outputs]
        for name, array in outputs.items():
            if np.ndim(array) == 0 or array.shape[0] != rows:
                raise InferenceError(
                    Status.INTERNAL,
                    f"output '{name}' has shape {list(np.shape(array))}, expected {rows} rows for the batch",
                )
        results: list[Arrays] = []
        offset = 0
        for job in jobs:
            end = offset + job.batch_size
            results.append({name: array[offset:end] for name, array in outputs.items()})
            offset = end
        return results

    def _backend_error(self, exc: BaseException) -> InferenceError:
        prefix = f"{self.model_name} version {self.version}: "
        if isinstance(exc, InferenceError):
            message = exc.message if exc.message.startswith(prefix) else prefix + exc.message
            return InferenceError(exc.status, message)
        log.warning("%s version %d: inference failed: %s", self.model_name, self.version, exc)
        return InferenceError(Status.INTERNAL, f"{prefix}{exc}")

    def _fail(self, jobs: list[Job], error: InferenceError, reason: str) -> None:
        now = time.monotonic_ns()
        for job in jobs:
            self.stats.record_fail(now - job.arrival_ns, reason)
            self._deliver(job, error)

    def _deliver(self, job: Job, result: Arrays | BaseException) -> None:
        try:
            job.done(result)
        except Exception:
            log.exception("%s version %d: the result callback of request '%s' failed",
                          self.model_name, self.version, job.request_id)  # fmt: skip
