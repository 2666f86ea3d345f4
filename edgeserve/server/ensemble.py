"""The ensemble engine: runs an ensemble request's DAG of steps (Triton's `ensemble_scheduling`).

An ensemble is served like any model (the data plane validates its inputs and builds its response),
but where a model has a `Scheduler` an ensemble has an `EnsembleScheduler`. Each request becomes a
`_Run`: every step whose inputs all exist is submitted, as a `Job` of numpy arrays (no
serialization), to its own model's scheduler, so it is batched with that model's other traffic and
counted in that model's statistics. The step's completion (on the model's worker thread) stores its
outputs and submits the steps that became ready, so independent steps run in parallel without a
hop through the event loop. The request's timeout is a deadline for the whole DAG: each step gets the
time that is left.

Only the steps the requested outputs need run (`EnsemblePlan.needed`: back from those outputs
through the DAG). The first failing step fails the request with the step named; then steps not yet
submitted are never submitted, its steps still queued in their models' schedulers are cancelled
there (answered CANCELLED, never run), and the results of steps already running are dropped.

A step with more rows than its model's max_batch_size is split into chunks (the pipeline's crop
count is data-dependent); a step with zero rows answers empty outputs without calling its model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeserve.protocol.errors import InferenceError, Status, internal, unavailable
from edgeserve.protocol.inference import InferRequest, InputTensor
from edgeserve.scheduling.job import Arrays, Job
from edgeserve.scheduling.stats import Duration, JobTiming, ModelStats
from edgeserve.server import validation
from edgeserve.server.ensemble_graph import EnsemblePlan, Step
from edgeserve.server.ensemble_steps import Gather, chunks_of, datatype_of, empty_outputs

if TYPE_CHECKING:
    from edgeserve.server.contracts import ServedModelLike

log = logging.getLogger("edgeserve.ensemble")

# (model name, version "" = latest) -> the ready served version; raises InferenceError otherwise.
Resolver = Callable[[str, str], "ServedModelLike"]
# (model, version, wait s) -> a future done when a step model that loads on demand serves, or None
# when it is not such a model (the repository's load_on_demand, as the data plane uses it).
LoadOnDemand = Callable[[str, str, float], "concurrent.futures.Future[None] | None"]


@dataclass(slots=True)
class _StepCounters:
    success: Duration = field(default_factory=Duration)
    fail: int = 0


class EnsembleStats(ModelStats):
    """The ensemble's own statistics (one success per request) plus each step's count and time
    (submit to outputs, queueing in the step model included) under the extra key `ensemble_steps`."""

    def __init__(self, name: str, version: int, plan: EnsemblePlan) -> None:
        super().__init__(name, version)
        self._plan = plan
        self._steps = [_StepCounters() for _ in plan.steps]
        self._step_lock = threading.Lock()

    def record_step(self, index: int, ns: int, ok: bool) -> None:
        with self._step_lock:
            if ok:
                self._steps[index].success.add(ns)
            else:
                self._steps[index].fail += 1

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        with self._step_lock:
            data["ensemble_steps"] = [
                {"step": s.index, "model": s.model_name, "version": s.model_version or "-1",
                 "success": c.success.as_dict(), "fail": c.fail}
                for s, c in zip(self._plan.steps, self._steps, strict=True)
            ]  # fmt: skip
        return data


class EnsembleScheduler:
    """Stands where a model's Scheduler stands (`SchedulerLike`, plus drain/close for the repository)."""

    def __init__(self, plan: EnsemblePlan, config: Any, stats: EnsembleStats, resolve: Resolver,
                 touch: Callable[[str], None] | None = None,
                 load_on_demand: LoadOnDemand | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.config = config
        self.stats = stats
        self.resolve = resolve
        self.touch = touch  # a step counts as a use of its model (memory-budget LRU)
        self.load_on_demand = load_on_demand
        self.model_name = plan.name
        self._lock = threading.Lock()
        self._runs: set[_Run] = set()
        self._accepting = True
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def pending_count(self) -> int:
        """Requests whose DAG is in progress (their steps are counted by their own models)."""
        return len(self._runs)

    instance_count = 0  # no instances of its own

    def submit(self, job: Job) -> None:
        run = _Run(self, job)
        with self._lock:
            if not self._accepting:
                self.stats.record_fail(time.monotonic_ns() - job.arrival_ns, "REJECTED")
                raise unavailable(f"ensemble '{self.plan.name}' is unloading")
            self._runs.add(run)
        run.start()

    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool:
        return False  # its steps run on their own models' schedulers

    def cancel(self, jobs: list[Job]) -> None:
        """The requests of `jobs` (this ensemble is a step of another that failed) end CANCELLED and
        cancel their own queued steps."""
        wanted = {id(job) for job in jobs}
        with self._lock:
            runs = [run for run in self._runs if id(run.job) in wanted]
        for job in jobs:
            job.cancelled = True
        for run in runs:
            run.fail(None, InferenceError(Status.CANCELLED, f"ensemble '{self.plan.name}': cancelled"))

    def _finished(self, run: _Run) -> None:
        with self._lock:
            self._runs.discard(run)
            if self._runs:
                return
            waiters, self._idle_waiters = self._idle_waiters, []
        for loop, waiter in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, waiter)

    async def drain(self, timeout_s: float) -> bool:
        """Stop accepting and wait for the requests in progress; False when `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._accepting = False
            if not self._runs:
                return True
            self._idle_waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Fail whatever is still in progress (after drain timed out)."""
        with self._lock:
            self._accepting = False
            runs = list(self._runs)
        for run in runs:
            run.fail(None, unavailable(f"ensemble '{self.plan.name}' was unloaded"))


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Run:
    """One ensemble request in progress."""

    def __init__(self, owner: EnsembleScheduler, job: Job) -> None:
        self.owner = owner
        self.job = job
        self.plan = owner.plan
        self.tensors: Arrays = dict(job.inputs)
        # optional ensemble inputs this request left out: their readers run without them
        self.absent = {name for name in self.plan.optional if name not in self.tensors}
        self.wanted = job.outputs or self.plan.outputs
        self.needed, self.needed_tensors = self.plan.needed(self.wanted)
        self.started: set[int] = set()
        self.submitted: list[tuple[Any, Job]] = []  # (step model's scheduler, job): cancelled on failure
        self.running = 0
        self.finished = False
        self.lock = threading.Lock()
        self.deadline_ns = job.arrival_ns + job.timeout_us * 1000 if job.timeout_us > 0 else 0

    # -- progress ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._advance()

    def _advance(self) -> None:
        """Submit every step that became ready; finish when nothing runs and nothing can start."""
        with self.lock:
            if self.finished:
                return
            ready: list[Step] = []
            for index in self.plan.order:
                step = self.plan.steps[index]
                if (
                    index in self.needed
                    and index not in self.started
                    and all(t in self.tensors or t in self.absent for t in step.inputs.values())
                ):
                    self.started.add(index)
                    ready.append(step)
            self.running += len(ready)
            done = self.running == 0
        if done:
            self._complete()
            return
        for step in ready:
            self._submit(step)

    def _complete(self) -> None:
        missing = [name for name in self.wanted if name not in self.tensors]
        if missing:
            never = [
                s.label for s in self.plan.steps if s.index in self.needed and s.index not in self.started
            ]
            text = f"{', '.join(missing)} (steps never run: {', '.join(never) or 'none'})"
            self.fail(None, internal(f"ensemble '{self.plan.name}' did not produce output(s) {text}"))
            return
        outputs = {name: self.tensors[name] for name in self.wanted}
        with self.lock:
            if self.finished:
                return
            self.finished = True
        total = time.monotonic_ns() - self.job.arrival_ns
        self.owner.stats.record_execution(self.job.batch_size, 0, total, 0, [JobTiming(total, 0, 0)])
        self._answer(outputs)

    def fail(self, step: Step | None, error: BaseException) -> None:
        with self.lock:
            if self.finished:
                return
            self.finished = True
            submitted = [(scheduler, job) for scheduler, job in self.submitted if not job.finished]
        self._cancel(submitted)
        if not isinstance(error, InferenceError):
            error = internal(str(error))
        if step is not None:
            error = InferenceError(error.status, f"ensemble '{self.plan.name}' {step.label}: {error.message}")
        reason = "REJECTED" if error.status is Status.UNAVAILABLE else "BACKEND"
        self.owner.stats.record_fail(time.monotonic_ns() - self.job.arrival_ns, reason)
        self._answer(error)

    @staticmethod
    def _cancel(submitted: list[tuple[Any, Job]]) -> None:
        """Cancel this request's step jobs: the queued ones never run (a job a worker already took
        finishes; its answer is dropped by `_step_done`)."""
        for scheduler, job in submitted:
            job.cancelled = True  # a scheduler without `cancel` still sees it before running the job
            cancel = getattr(scheduler, "cancel", None)
            if cancel is not None:
                try:
                    cancel([job])
                except Exception:  # pragma: no cover - a bug there must not lose this answer
                    log.exception("cancelling a step of ensemble request '%s' failed", job.request_id)

    def _answer(self, result: Arrays | BaseException) -> None:
        try:
            self.job.done(result)
        finally:
            self.owner._finished(self)

    # -- one step ---------------------------------------------------------------------------------
    def _submit(self, step: Step, started: int = 0, may_load: bool = True) -> None:
        started = started or time.monotonic_ns()
        try:
            served = self._resolve(step, started, may_load)
            if served is None:
                return  # loading on demand: submitted again when it serves
            inputs, rows = self._step_inputs(step, served)
            remaining_us = 0
            if self.deadline_ns:
                remaining_us = (self.deadline_ns - started) // 1000
                if remaining_us <= 0:
                    raise InferenceError(
                        Status.UNAVAILABLE, "Request timeout expired before the step started"
                    )
            # what this request reads of the step: a nested ensemble runs only the steps for it
            wanted = tuple(key for key, tensor in step.outputs.items() if tensor in self.needed_tensors)
            max_batch = int(served.config.max_batch_size)
            chunks = chunks_of(rows, max_batch)
            if not chunks:  # zero rows: nothing to compute
                self._step_done(step, started, empty_outputs(served.config))
                return
            jobs: list[Job] = []
            gather = Gather(len(chunks), lambda result: self._step_done(step, started, result))
            for part, (begin, end) in enumerate(chunks):
                piece = inputs if len(chunks) == 1 else {k: v[begin:end] for k, v in inputs.items()}
                # Each chunk is checked exactly as the data plane checks a request to that model.
                request = InferRequest(step.model_name, inputs=[
                    InputTensor(k, datatype_of(served.config, k), tuple(v.shape), v) for k, v in piece.items()
                ])  # fmt: skip
                arrays, batch = validation.validated_inputs(request, served.config, step.model_name)
                jobs.append(Job(inputs=arrays, batch_size=batch, done=gather.callback(part),
                                priority=self.job.priority, timeout_us=remaining_us,
                                request_id=self.job.request_id, client=self.job.client,
                                outputs=wanted))  # fmt: skip
            scheduler = served.scheduler
            with self.lock:
                if self.finished:  # another step failed meanwhile: this one is not wanted any more
                    return
                self.submitted.extend((scheduler, job) for job in jobs)
            for job in jobs:
                scheduler.submit(job)
        except BaseException as exc:
            self._step_done(step, started, exc)

    def _resolve(self, step: Step, started: int, may_load: bool) -> ServedModelLike | None:
        """The step's model; None when it is being loaded for this step (load on first use, or
        unloaded for the memory budget): `_submit` runs again once it serves."""
        owner = self.owner
        try:
            served = owner.resolve(step.model_name, step.model_version)
        except InferenceError as exc:
            if exc.status is not Status.UNAVAILABLE or owner.load_on_demand is None or not may_load:
                raise
            wait_s = max(0.0, (self.deadline_ns - time.monotonic_ns()) / 1e9) if self.deadline_ns else 0.0
            loading = owner.load_on_demand(step.model_name, step.model_version, wait_s)
            if loading is None:
                raise
            loading.add_done_callback(lambda done: self._loaded(step, started, done))
            return None
        if owner.touch is not None:
            owner.touch(step.model_name)
        return served

    def _loaded(self, step: Step, started: int, done: concurrent.futures.Future[None]) -> None:
        error = done.exception()
        if error is not None:
            self._step_done(step, started, error)
        else:
            self._submit(step, started, may_load=False)  # once: a model unloaded again fails the step

    def _step_inputs(self, step: Step, served: ServedModelLike) -> tuple[Arrays, int]:
        """The step's inputs, cast to its model's declared data types where a producer returned
        another (as the data plane casts a response); (inputs, rows on the batch axis or 1)."""
        specs = validation.compiled(served.config).inputs
        arrays: Arrays = {}
        for key, name in step.inputs.items():
            if name in self.absent:
                continue  # the step model must take it as optional (its checks say so otherwise)
            array = self.tensors[name]
            dtype = specs[key].dtype
            arrays[key] = array.astype(dtype) if dtype is not None and array.dtype != dtype else array
        if served.config.max_batch_size <= 0 or not arrays:
            return arrays, 1  # (no inputs at all: the model's own checks name what is missing)
        rows = {int(a.shape[0]) if a.ndim else -1 for a in arrays.values()}
        if len(rows) != 1:
            raise InferenceError(Status.INVALID_ARG, "its inputs have different batch sizes: "
                                 + ", ".join(f"{k} {list(a.shape)}" for k, a in arrays.items()))  # fmt: skip
        count = rows.pop()
        if count < 0:
            raise InferenceError(Status.INVALID_ARG, f"model '{step.model_name}' batches, but its inputs "
                                 "have no batch dimension")  # fmt: skip
        return arrays, count

    def _step_done(self, step: Step, started_ns: int, result: Arrays | BaseException) -> None:
        elapsed = time.monotonic_ns() - started_ns
        stats = self.owner.stats
        if self.finished and isinstance(result, InferenceError) and result.status is Status.CANCELLED:
            return  # cancelled by this request's failure: it never ran
        if isinstance(result, BaseException):
            stats.record_step(step.index, elapsed, ok=False)
            self.fail(step, result)
            return
        missing = [key for key in step.outputs if key not in result]
        if missing:
            stats.record_step(step.index, elapsed, ok=False)
            self.fail(step, internal(f"model did not produce output(s) {', '.join(missing)}"))
            return
        stats.record_step(step.index, elapsed, ok=True)
        with self.lock:
            if self.finished:
                return
            for key, name in step.outputs.items():
                self.tensors[name] = result[key]
            self.running -= 1
        self._advance()
