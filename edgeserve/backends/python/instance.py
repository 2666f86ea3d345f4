"""`PythonInstance`: one instance of a Python model, backed by one worker process.

- infer(): the inputs are copied once into the shared memory, the worker runs `execute`, the
  outputs are copied once out of it (the region is reused by the next call). infer_requests(): the
  same for a scheduler batch of several jobs, one pb_utils request per job (Triton's semantics);
  the scheduler calls it instead of concatenating the batch.
- An exception in execute(), or a response with `error=TritonError(...)`, fails that call with the
  model's message (status INTERNAL, or the TritonError's code); the worker lives on.
- A worker that dies during a call (os.abort(), a segfault, sys.exit, the OOM killer) fails the call
  with INTERNAL naming the model, the instance and the exit signal or code, and is restarted at once
  in the background; a restart that fails (initialize raises) is retried with backoff (0.5 s
  doubling to 30 s), and calls meanwhile fail fast with UNAVAILABLE and the last error.
- A call that runs past `hang_timeout_s` (+ a grace, so the scheduler's hang detector answers
  first) kills the worker (SIGTERM, SIGKILL after 1 s) and fails with UNAVAILABLE; the next call
  starts a new one. close() kills a worker with a call in flight at once and gives an idle worker
  `finalize()` and a few seconds to exit; either way the process is reaped.
- In a `python_worker_group` (group.py) the worker process is the group's: a crash or a kill (a hang)
  takes every member down, and each restarts at once (the first starts a new worker, the others join
  it); a member's own import or initialize() failure, and close() of an idle member, leave it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgeserve.backends import memory, streams
from edgeserve.backends.base import Array, ModelIO, RequestInfo
from edgeserve.backends.python import events, wire
from edgeserve.backends.python.process import Worker, WorkerDied, WorkerSpec, WorkerStopped, WorkerTimeout
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status

log = logging.getLogger("edgeserve.backends.python")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
FINALIZE_GRACE_S = 5.0
KILL_GRACE_S = 1.0


def _status(name: Any) -> Status:
    try:
        return Status(str(name))
    except ValueError:
        return Status.INTERNAL


def start_worker(spec: WorkerSpec, stop: threading.Event | None = None) -> Worker:
    """A worker with the model imported and initialized; InferenceError (INVALID_ARG: the model's
    fault) naming the traceback's last line when import or initialize() fails."""
    worker = Worker(spec)
    try:
        for message in (
            {"op": "load", "model_file": str(spec.model_file)},
            {"op": "initialize", "args": spec.args},
        ):
            reply = worker.request(message, spec.start_timeout_s, stop)
            if "error" in reply:
                what = "import" if message["op"] == "load" else "initialize()"
                log.error("%s: %s failed:\n%s", spec.label, what, reply.get("traceback") or reply["error"])
                raise InferenceError(Status.INVALID_ARG, f"{spec.label}: {what} failed: {reply['error']}")
    except WorkerDied as exc:
        worker.kill(KILL_GRACE_S)
        raise InferenceError(
            Status.INTERNAL,
            f"{spec.label}: the Python worker (pid {worker.pid}) {exc} while loading the model",
        ) from None
    except WorkerTimeout:
        worker.kill(KILL_GRACE_S)
        raise InferenceError(
            Status.UNAVAILABLE, f"{spec.label}: loading the model took longer than {spec.start_timeout_s:g} s"
        ) from None
    except BaseException:  # the model's own import or initialize() failed: its group lives on
        worker.discard(KILL_GRACE_S)
        raise
    log.info("%s: Python worker pid %d ready", spec.label, worker.pid)
    return worker


def _same_kind(returned: str, declared: str) -> bool:
    """Numbers the server may cast to the config's type: INT64 for INT32, FP64 for FP32 (not FP64 for
    INT32, nor a string for a number)."""
    if not (datatypes.is_known(returned) and datatypes.is_known(declared)):
        return False
    have, want = datatypes.numpy_dtype(returned), datatypes.numpy_dtype(declared)
    return have.kind in "iuf" and want.kind in "iuf" and bool(np.can_cast(have, want, "same_kind"))


class PythonInstance:
    # The scheduler may close() it while a call runs (unload of a hung model): that kills the worker.
    close_while_busy = True

    def __init__(self, spec: WorkerSpec, io: ModelIO, worker: Worker) -> None:
        self.spec = spec
        self.io = io
        self._types = {t.name: t.datatype for t in io.outputs}
        self._warned: set[str] = set()  # outputs answered in a datatype other than the config's
        self.fallback_reason: str | None = None
        self.restarts = 0  # workers started after a crash or a hang
        self._worker: Worker | None = worker
        self._call = threading.Lock()  # one infer at a time
        self._state = threading.Lock()  # guards _worker, _restarter, _closed
        self._stop = threading.Event()
        self._attempted = threading.Event()  # a restart attempt finished (worker up or failed)
        self._restarter: threading.Thread | None = None
        self._last_error = ""
        self._closed = False
        self._calls = 0  # execute calls sent; each reply must carry its call's number
        self._region_keep = memory.current().worker_region_keep
        self._model = spec.args.get("model_name", "")
        events.count_instance(self._model, 1)
        self._watch(worker)

    @property
    def pid(self) -> int | None:
        worker = self._worker
        return worker.pid if worker is not None else None

    # -- calls -------------------------------------------------------------------------------------
    def infer(self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        """One call of execute() with one request (the batch the scheduler assembled)."""
        if self.spec.decoupled:
            raise streams.decoupled_error()
        result = self._execute([inputs], outputs)[0]
        if isinstance(result, InferenceError):
            raise result
        return result

    def infer_requests(
        self, batch: Sequence[Mapping[str, Array]], infos: Sequence[RequestInfo] | None = None
    ) -> list[dict[str, Array] | InferenceError]:
        """One call of execute() with one request per job of the scheduler's batch (Triton's
        semantics), `infos[i]` telling request i its ID, parameters, correlation ID and flags: each
        gets its own response or error, in the batch's order. A failure of the whole call (execute()
        raised, the worker died or hung) raises."""
        if infos is not None and len(infos) != len(batch):
            raise InferenceError(
                Status.INTERNAL, f"{self.spec.label}: {len(infos)} infos for {len(batch)} requests"
            )
        if self.spec.decoupled:
            raise streams.decoupled_error()
        return self._execute(batch, None, infos)

    def infer_decoupled(
        self, batch: Sequence[Mapping[str, Array]], infos: Sequence[RequestInfo],
        sinks: Sequence[streams.ResponseSink],
    ) -> None:  # fmt: skip
        """streams.StreamingInstance: one execute() of a decoupled model; its responses reach the
        sinks as the model sends them (also after this returned). A failure of the call (execute()
        raised, the worker died or hung) ends each request that is still open with the error."""
        if len(infos) != len(batch) or len(sinks) != len(batch):
            raise InferenceError(Status.INTERNAL, f"{self.spec.label}: {len(batch)} requests, "
                                 f"{len(infos)} infos, {len(sinks)} sinks")  # fmt: skip
        opened: list[tuple[events.Events, list[int]]] = []
        try:
            self._execute(batch, None, infos, sinks, opened)
        except InferenceError as exc:
            if opened:  # registered: end those still open (the worker's end may have ended them)
                opened[0][0].fail(opened[0][1], exc)
                return
            for sink in sinks:
                with contextlib.suppress(InferenceError):
                    sink.send(None, final=True, error=exc)

    def _execute(
        self, batch: Sequence[Mapping[str, Array]], outputs: Sequence[str] | None,
        infos: Sequence[RequestInfo] | None = None, sinks: Sequence[streams.ResponseSink] | None = None,
        opened: list[tuple[events.Events, list[int]]] | None = None,
    ) -> list[dict[str, Array] | InferenceError]:  # fmt: skip
        with self._call:
            worker = self._live_worker()
            requests = []
            end = 0
            for index, inputs in enumerate(batch):
                headers, end = wire.write_tensors(worker.region, inputs.items(), end)
                entry = wire.request_entry(infos[index] if infos is not None else None)
                requests.append({**entry, "inputs": headers, "outputs": list(outputs or [])})
            self._calls += 1
            call = self._calls
            message = {"op": "execute", "call": call, "size": worker.region.size, "requests": requests}
            if sinks is not None and opened is not None:
                rids = worker.dispatch.open(sinks)
                opened.append((worker.dispatch, rids))
                for request, rid in zip(requests, rids, strict=True):
                    request["rid"] = rid
                message["decoupled"] = True
            label = self.spec.label
            try:
                reply = worker.request(message, self.spec.call_timeout_s, self._stop)
            except WorkerDied as exc:
                if self._closed:  # close() killed it under this call: the call ends as closed
                    raise self._closed_error() from None
                self._lost(worker, restart=True)
                raise InferenceError(
                    Status.INTERNAL,
                    f"{label}: the Python worker (pid {worker.pid}) {exc} while executing the request; "
                    "restarting it",
                ) from None
            except WorkerTimeout:
                worker.kill(KILL_GRACE_S)
                self._lost(worker, restart=False)
                raise InferenceError(
                    Status.UNAVAILABLE,
                    f"{label}: execute() did not return in {self.spec.call_timeout_s:g} s; "
                    f"the Python worker (pid {worker.pid}) was killed",
                ) from None
            except WorkerStopped:
                raise self._closed_error() from None
            if reply.get("call") != call:
                # Not this call's answer (a stale reply): its responses must never reach these
                # requests. The channel is out of step, so the worker goes.
                self._lost(worker, restart=True)
                raise InferenceError(
                    Status.INTERNAL,
                    f"{label}: the Python worker (pid {worker.pid}) answered call {reply.get('call')!r} "
                    f"instead of {call}; restarting it",
                )
            if "error" in reply:  # execute() raised, or returned the wrong thing: the whole batch fails
                raise InferenceError(_status(reply.get("status")), f"{label}: {reply['error']}")
            if sinks is not None:
                return []
            responses = reply.get("responses")
            if not isinstance(responses, list) or len(responses) != len(batch):
                raise InferenceError(Status.INTERNAL, f"{label}: a bad reply from the Python worker")
            answers = [self._response(worker, response, outputs) for response in responses]
            if worker.region.size > self._region_keep:  # the outputs were copied out
                worker.region.discard(self._region_keep)
            return answers

    def _response(
        self, worker: Worker, response: Any, wanted: Sequence[str] | None
    ) -> dict[str, Array] | InferenceError:
        if "error" in response:
            return InferenceError(_status(response.get("status")), str(response["error"]))
        for header in response.get("outputs") or ():
            declared = self._types.get(str(header.get("n")))
            if declared is None or header.get("t") == declared:
                continue
            if not _same_kind(str(header.get("t")), declared):
                return InferenceError(
                    Status.INTERNAL,
                    f"{self.spec.label}: execute() returned output '{header.get('n')}' as {header.get('t')}, "
                    f"but the config declares {declared}",
                )
            if header.get("n") not in self._warned:
                # Triton takes it (its bls_decoupled example sums into an INT64 array for an INT32
                # output); the server casts it to the config's type. Said once, so the model can be fixed.
                self._warned.add(str(header.get("n")))
                log.warning("%s: execute() returned output '%s' as %s, but the config declares %s; cast",
                            self.spec.label, header.get("n"), header.get("t"), declared)  # fmt: skip
        try:
            out = {
                str(h["n"]): wire.read_tensor(worker.region, h, copy=True)
                for h in response["outputs"]
                if not wanted or h["n"] in wanted
            }
        except (ValueError, KeyError, TypeError, InferenceError) as exc:
            message = exc.message if isinstance(exc, InferenceError) else str(exc)
            return InferenceError(Status.INTERNAL, f"{self.spec.label}: a bad response: {message}")
        missing = [n for n in wanted or () if n not in out]
        if missing:
            return InferenceError(
                Status.INTERNAL, f"{self.spec.label}: execute() returned no output {', '.join(missing)}"
            )
        return out

    def _closed_error(self) -> InferenceError:
        return InferenceError(Status.UNAVAILABLE, f"{self.spec.label}: the instance is closed")

    # -- restarts ----------------------------------------------------------------------------------
    def _live_worker(self) -> Worker:
        with self._state:
            if self._closed:
                raise self._closed_error()
            worker = self._worker
        if worker is not None and worker.alive():
            return worker
        if worker is not None:  # died while idle
            log.warning("%s: the Python worker (pid %d) %s while idle", self.spec.label, worker.pid,
                        worker.exit_text())  # fmt: skip
            self._lost(worker, restart=False)
        with self._state:
            backing_off = self._restarter is not None and self._restarter.is_alive() and self._last_error
        if not backing_off:
            self._attempted.clear()
            self._ensure_restarter()
            with self._state:
                worker = self._worker
            if worker is None:
                self._attempted.wait(self.spec.start_timeout_s)
        with self._state:
            worker = self._worker
        if worker is None:
            detail = f": {self._last_error}" if self._last_error else ""
            raise InferenceError(
                Status.UNAVAILABLE, f"{self.spec.label}: the Python worker is restarting{detail}"
            )
        return worker

    def _watch(self, worker: Worker) -> None:
        """A grouped worker's process may die under another member: restart with the group at once."""
        worker.on_exit(lambda: self._group_down(worker))

    def _group_down(self, worker: Worker) -> None:
        with self._state:
            mine = not self._closed and self._worker is worker
        if mine:
            log.warning("%s: the group's Python worker (pid %d) %s; restarting with its group",
                        self.spec.label, worker.pid, worker.exit_text())  # fmt: skip
            self._lost(worker, restart=True)

    def _lost(self, worker: Worker, restart: bool) -> None:
        worker.kill(KILL_GRACE_S)
        with self._state:
            if self._worker is worker:
                self._worker = None
        if restart:
            self._ensure_restarter()

    def _ensure_restarter(self) -> None:
        with self._state:
            if self._closed or (self._restarter is not None and self._restarter.is_alive()):
                return
            self._restarter = threading.Thread(
                target=self._restart_loop, name=f"edgeserve-python-restart-{self.spec.label}", daemon=True
            )
            self._restarter.start()

    def _restart_loop(self) -> None:
        delay = BACKOFF_START_S
        while not self._stop.is_set():
            try:
                worker = start_worker(self.spec, self._stop)
            except WorkerStopped:
                break
            except Exception as exc:
                self._last_error = exc.message if isinstance(exc, InferenceError) else str(exc)
                log.error("%s: restarting the Python worker failed (retry in %g s): %s",
                          self.spec.label, delay, self._last_error)  # fmt: skip
                self._attempted.set()
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            with self._state:
                keep = not self._closed
                if keep:
                    self._worker = worker
                    self.restarts += 1
            if not keep:
                worker.discard(KILL_GRACE_S)
            else:
                self._watch(worker)
            self._last_error = ""
            log.warning("%s: Python worker restarted (pid %d)", self.spec.label, worker.pid)
            break
        self._attempted.set()

    # -- close -------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            worker, self._worker = self._worker, None
            restarter = self._restarter
        events.count_instance(self._model, -1)
        self._stop.set()
        if worker is not None:
            if self._call.acquire(blocking=False):
                try:
                    worker.stop(FINALIZE_GRACE_S)
                finally:
                    self._call.release()
            else:  # a call is in flight (hung, or abandoned by the scheduler): kill it
                worker.kill(KILL_GRACE_S)
        if restarter is not None:
            restarter.join(10.0)
