"""One model version's scheduler: a shared priority queue, a dynamic batcher and one worker thread
per backend instance (runtimes release the GIL while they compute).

A worker takes the queue head and the later jobs whose inputs have the same per-row shapes and
dtypes (`Job.shape_key`), up to `max_batch_size` rows. While that batch is below the largest
preferred batch size (or max_batch_size) it waits up to `max_queue_delay_microseconds`, measured
from the head job's enqueue, for more. Idle workers also wake at the nearest queued deadline, so a
timed-out REJECT job fails promptly.

Copies: a batch of one job hands the job's arrays to the backend as they are; a batch of several
gathers each input once into a reused buffer (buffers.py). Outputs go back to each job as row
views.

Inline runs: a frontend may run a job on its own thread (`try_run_inline`, inline.py).

Accounting: every request that reaches `submit` ends in exactly one `job.done` call and one stats
record (`record_fail` for rejections here, including the ones `submit` raises; the caller records
only the failures it finds before calling `submit`).

Overload: see queue.py (a wait-based soft cap from the measured compute time per job, fair shares
between clients); a rejection is immediate, never a wait.

Hangs and request timeouts while a batch runs: hangs.py (a watchdog thread).
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

from edgeserve.backends.base import RequestInfo
from edgeserve.backends.options import DEFAULT_HANG_TIMEOUT_S
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.buffers import BatchBuffers
from edgeserve.scheduling.decoupled import DecoupledRuns
from edgeserve.scheduling.hangs import _WATCHDOG, HangWatch, InstanceFactory
from edgeserve.scheduling.inline import INLINE_WINDOW_MAX_NS, InlineRuns
from edgeserve.scheduling.job import CURRENT_CLIENT, Arrays, Job, answer
from edgeserve.scheduling.queue import (
    DEFAULT_HARD_QUEUE_CAP,
    MAX_QUEUE_WAIT_S,
    QUEUE_FULL_MESSAGE,
    TIMEOUT_MESSAGE,
    JobQueue,
)
from edgeserve.scheduling.stats import JobTiming, ModelStats
from edgeserve.scheduling.versioned import ModelVersionScheduler

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

    from edgeserve.backends.base import Instance

log = logging.getLogger("edgeserve.scheduler")

_NS_PER_S = 1_000_000_000
__all__ = ["DEFAULT_HANG_TIMEOUT_S", "INLINE_WINDOW_MAX_NS", "InstanceFactory", "Scheduler"]


def _shape_key(job: Job) -> tuple[Any, ...]:
    """Jobs batch together only when every input has the same dtype and per-row shape."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in job.inputs.items()))


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Scheduler(ModelVersionScheduler, DecoupledRuns, InlineRuns, HangWatch):
    def __init__(self, model_name: str, version: int, config: ModelConfig, instances: list[Instance],
                 stats: ModelStats, *, hard_queue_cap: int = DEFAULT_HARD_QUEUE_CAP,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 instance_factory: InstanceFactory | None = None,
                 max_queue_wait_s: float = MAX_QUEUE_WAIT_S) -> None:  # fmt: skip
        self._init_version(model_name, version, config, instances, stats)
        self._queue = JobQueue.from_config(config, hard_queue_cap)
        self._batching = bool(config.HasField("dynamic_batching") and config.max_batch_size > 0)
        self.decoupled = bool(config.model_transaction_policy.decoupled)  # decoupled.py
        self._live: dict[int, Job] = {}
        self._max_rows = int(config.max_batch_size) if self._batching else 0
        self._buffers = BatchBuffers(self._max_rows)  # reused gather buffers (buffers.py)
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
        self.inline_runs = 0  # jobs run by `try_run_inline` (under the lock)
        self.job_cost_ewma_ns = 0  # recent compute time per job (batch time / jobs in it)
        self._max_wait_ns = int(max_queue_wait_s * _NS_PER_S)
        # Soft queue cap (queue.py): never below a couple of full batches per instance.
        self._cap_floor = max(8, 2 * len(self._instances) * max(1, self._target_rows))
        self._soft_cap = 0  # 0 = none yet (nothing measured)
        self._hang_ns = int(hang_timeout_s * _NS_PER_S)
        self._factory = instance_factory
        self._batches: dict[int, tuple[list[Job], int]] = {}  # instance index -> (jobs, start)
        self._generation = [0] * len(self._instances)  # bumped when an instance is replaced
        self._replacing: set[int] = set()
        self.replaced = 0  # instances replaced after a hang
        self._accepting = True  # False once drain/close began
        self._stopping = False  # workers exit when they find the queue empty
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for index, instance in enumerate(self._instances):
                self._threads.append(self._make_thread(index, instance, 0))
            threads = list(self._threads)
        for thread in threads:
            thread.start()
        if self._hang_ns > 0:
            _WATCHDOG.add(self)

    def _make_thread(self, index: int, instance: Instance, generation: int) -> threading.Thread:
        suffix = f".{generation}" if generation else ""
        return threading.Thread(
            target=self._worker, args=(index, instance, generation), daemon=True,
            name=f"edgeserve-{self.model_name}-v{self.version}-{index}{suffix}",
        )  # fmt: skip

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
        if not job.client:
            job.client = CURRENT_CLIENT.get()
        with self._lock:
            try:
                if not self._accepting:
                    raise self._unloading()
                level = self._queue.level_of(int(job.priority))
                evicted = self._queue.push(job, level, time.monotonic_ns(), self._soft_cap)
            except InferenceError as exc:
                reason = "REJECTED" if exc.status is Status.UNAVAILABLE and self._accepting else "OTHER"
                self.stats.record_fail(time.monotonic_ns() - job.arrival_ns, reason)
                raise
            self._wake_worker()
        if evicted is not None:  # a heavier client's newest job made room for this one
            self._fail([evicted], InferenceError(Status.UNAVAILABLE, QUEUE_FULL_MESSAGE), "REJECTED")

    def refuses(self, client: str) -> bool:
        """True (and counted as a rejected request) when a request of `client` would find the queue
        full: the frontend then answers UNAVAILABLE before reading its tensors, which is what keeps an
        overloaded server's rejections cheap. Lock-free hint; `submit` decides exactly."""
        if not self._accepting or not self._queue.would_refuse(client, self._soft_cap):
            return False
        self.stats.record_fail(0, "REJECTED")
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
            leftover = self._queue.pop_all() + self._end_all_live()
            self._work.notify_all()
            if self._executing == 0:
                self._notify_idle()
        self._fail(leftover, self._unloading(), "OTHER")
        alive = self._join(join_timeout_s)
        self._buffers.clear()
        with self._lock:  # an inline run still holds its instance
            self._idle.wait_for(lambda: not self._claimed, join_timeout_s)
        for index, instance in enumerate(self._instances):
            if index < len(self._threads) and self._threads[index] in alive:
                if not getattr(instance, "close_while_busy", False):
                    log.warning("%s version %d: instance %d still busy after %.0fs; not closing it",
                                self.model_name, self.version, index, join_timeout_s)  # fmt: skip
                    continue
                # e.g. a Python model's worker process: close() kills it, which ends the call
                log.warning("%s version %d: instance %d still busy after %.0fs; closing it anyway",
                            self.model_name, self.version, index, join_timeout_s)  # fmt: skip
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
    def _worker(self, index: int, instance: Instance, generation: int) -> None:
        while True:
            jobs, expired, taken_ns = self._next_batch(index, generation)
            if jobs is None:
                return
            try:
                if expired:
                    self._drop(expired)
                else:
                    self._execute(instance, jobs, taken_ns, index)
            except BaseException:  # a bug here must not leave the executing count wrong
                log.exception("%s version %d: worker failed", self.model_name, self.version)
            finally:
                current = self._after_batch(index, generation)
            if not current:  # this instance was declared hung and replaced meanwhile
                log.warning("%s version %d: hung instance %d answered at last; closing it",
                            self.model_name, self.version, index)  # fmt: skip
                with contextlib.suppress(Exception):
                    instance.close()
                return

    def _next_batch(self, index: int, generation: int) -> tuple[list[Job] | None, list[Job], int]:
        """(jobs to run, expired jobs to fail, time taken); jobs None = exit. Either list counts as
        executing (so `wait_idle` waits for its callbacks) until `_after_batch`."""
        with self._lock:
            while True:
                if self._generation[index] != generation:
                    return None, [], 0
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
                if any(job.cancelled for job in jobs):  # never run; answered by `_drop`
                    self._executing += 1
                    return [], self._queue.remove([job for job in jobs if job.cancelled]), now
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

    def _drop(self, jobs: list[Job]) -> None:
        """Fail jobs taken out of the queue unrun: cancelled by their requester, or timed out."""
        cancelled = [job for job in jobs if job.cancelled]
        if cancelled:
            self._fail(cancelled, self._cancelled(), "OTHER")
        if len(cancelled) < len(jobs):
            timed_out = [job for job in jobs if not job.cancelled]
            self._fail(timed_out, InferenceError(Status.UNAVAILABLE, TIMEOUT_MESSAGE), "REJECTED")

    def _cancelled(self) -> InferenceError:
        message = f"{self.model_name} version {self.version}: cancelled before it ran (its request ended)"
        return InferenceError(Status.CANCELLED, message)

    def cancel(self, jobs: list[Job]) -> None:
        """Mark `jobs` cancelled (their requester, an ensemble whose other step failed, no longer
        wants them): those still queued leave the queue now, answered CANCELLED, and never run; one
        a worker already took runs and its answer goes to the requester, which drops it."""
        with self._lock:
            for job in jobs:
                job.cancelled = True
            queued = self._claim(self._queue.remove(jobs)) + self._end_live(jobs)
            if queued and self._is_idle():
                self._notify_idle()
        if queued:
            self._fail(queued, self._cancelled(), "OTHER", claim=False)

    def _after_batch(self, index: int, generation: int) -> bool:
        """False when the instance was replaced while this batch ran (the watchdog settled the
        counts then): the worker must exit."""
        with self._lock:
            if self._generation[index] != generation:
                return False
            self._executing -= 1
            self._running.discard(index)
            if self._is_idle():
                self._notify_idle()
            return True

    def _claim(self, jobs: list[Job]) -> list[Job]:  # lock held
        """The jobs not answered yet, marked answered (each job is answered exactly once)."""
        live = [job for job in jobs if not job.finished]
        for job in live:
            job.finished = True
        return live

    def _execute(self, instance: Instance, jobs: list[Job], taken_ns: int, index: int) -> None:
        if self.decoupled:
            return self._execute_decoupled(instance, jobs, taken_ns, index)
        single = len(jobs) == 1
        rows = jobs[0].batch_size if single else sum(job.batch_size for job in jobs)
        entry = (jobs, taken_ns)
        self._batches[index] = entry  # a dict store: atomic, read by the watchdog
        # An instance with `infer_requests` (Python models: Triton's execute(requests)) takes the
        # batch as one input dict per job (with its ID and parameters) and answers each job on its
        # own, in the batch's order (outputs or an error).
        per_request = getattr(instance, "infer_requests", None)
        results: Sequence[Arrays | BaseException]
        try:
            batch = [job.inputs for job in jobs] if per_request is None else []
            inputs, lease = self._buffers.gather(batch) if batch else ({}, None)
            infer_start = time.monotonic_ns()
            if per_request is None:
                outputs = instance.infer(inputs)
                self._buffers.release(lease, outputs)  # unless an output is a view of it
            else:
                infos = [RequestInfo(job.request_id, parameters=job.parameters) for job in jobs]
                results = per_request([job.inputs for job in jobs], infos)
            infer_end = time.monotonic_ns()
            ewma = self.compute_ewma_ns
            spent = infer_end - infer_start
            self.compute_ewma_ns = spent if ewma == 0 else ewma + (spent - ewma) // 8
            self._measure(spent, len(jobs))
            if per_request is None:
                results = self._split(jobs, outputs, rows)
        except BaseException as exc:
            with self._lock:
                if self._batches.get(index) is entry:
                    del self._batches[index]
            self._fail(jobs, self._backend_error(exc), "BACKEND")
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            if self._batches.get(index) is entry:
                del self._batches[index]
            live = self._claim(jobs)
        if not live:
            return  # answered by the watchdog (timeout or hang) while it ran
        pairs: Sequence[tuple[Job, Arrays | BaseException]]
        if len(live) != len(jobs):
            kept = {id(job) for job in live}
            pairs = [(job, result) for job, result in zip(jobs, results, strict=True) if id(job) in kept]
        else:
            pairs = list(zip(jobs, results, strict=True))
        timings: list[JobTiming] = []
        for job, result in pairs:
            if isinstance(result, BaseException):  # one request of a per-request batch failed
                self.stats.record_fail(time.monotonic_ns() - job.arrival_ns, "BACKEND")
                self._deliver(job, self._backend_error(result))
                continue
            self._deliver(job, result)
            end = time.monotonic_ns()
            timings.append(JobTiming(end - job.arrival_ns, taken_ns - job.enqueue_ns, end - infer_end))
        output_end = time.monotonic_ns()
        self.stats.record_execution(rows, infer_start - taken_ns, infer_end - infer_start,
                                    output_end - infer_end, timings)  # fmt: skip

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

    def _measure(self, spent_ns: int, jobs: int) -> None:
        """Per-job compute time -> the wait-based soft cap of the queue."""
        per_job = spent_ns // max(1, jobs)
        ewma = self.job_cost_ewma_ns
        ewma = per_job if ewma == 0 else ewma + (per_job - ewma) // 8
        self.job_cost_ewma_ns = ewma
        if ewma > 0 and self._max_wait_ns > 0:
            self._soft_cap = max(self._cap_floor, self._max_wait_ns * len(self._instances) // ewma)

    @property
    def soft_queue_cap(self) -> int:
        """Jobs the queue takes before refusing (0 = not measured yet: only the hard cap)."""
        return self._soft_cap

    def _fail(self, jobs: list[Job], error: InferenceError, reason: str, *, claim: bool = True) -> None:
        if claim:
            with self._lock:
                jobs = self._claim(jobs)
        now = time.monotonic_ns()
        for job in jobs:
            self.stats.record_fail(now - job.arrival_ns, reason)
            self._deliver(job, error)

    def _deliver(self, job: Job, result: Arrays | BaseException) -> None:
        answer(job, result, self.model_name, self.version)
