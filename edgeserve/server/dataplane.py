"""The one data plane every frontend calls (MLServer's lesson): frontends only translate wire formats.

Lookup -> shm resolution -> validation -> scheduler; the scheduler calls back on a worker thread,
where the response is assembled (classification, writes into output shm) so the event loop only
encodes bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edgeserve import __version__
from edgeserve.backends.streams import decoupled_error
from edgeserve.frontends.shm.registry import SharedMemoryRegistry, ShmLease
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status, internal, invalid_arg, unavailable
from edgeserve.protocol.inference import InferRequest, InferResponse
from edgeserve.scheduling.cache import ResponseCache
from edgeserve.scheduling.job import CURRENT_CLIENT, Arrays, Job
from edgeserve.scheduling.queue import QUEUE_FULL_MESSAGE
from edgeserve.server import validation
from edgeserve.server.answers import LoopAnswer
from edgeserve.server.answers import on_loop as on_loop
from edgeserve.server.contracts import RepositoryLike, ServedModelLike
from edgeserve.server.logsettings import LogSettings
from edgeserve.server.outputs import ResponseAssembler
from edgeserve.server.streaming import ResponseStream, stream_bounds

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig


log = logging.getLogger("edgeserve.dataplane")

EXTENSIONS: tuple[str, ...] = (
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "logging",
)

ResponseCallback = Callable[["InferResponse | InferenceError"], None]
# Admission (`[server] max_inflight` = 0): the server takes this many times what its models' queues
# hold (their wait-based soft caps, plus a batch per instance) in flight at once, across frontends,
# and never fewer than MIN_AUTO_INFLIGHT; more are refused at once, before their tensors are read.
AUTO_INFLIGHT_FACTOR = 2
MIN_AUTO_INFLIGHT = 32
MAX_AUTO_INFLIGHT = 4096
_AUTO_REFRESH_NS = 250_000_000


class DataPlane:
    def __init__(
        self,
        repository: RepositoryLike,
        shm: SharedMemoryRegistry,
        *,
        strict_readiness: bool = True,
        model_control_mode: str = "explicit",
        max_inflight: int = 0,
        response_cache: ResponseCache | None = None,
    ) -> None:
        self.repository = repository
        self.response_cache = response_cache  # server-wide; used by models with response_cache.enable
        self.max_inflight = max_inflight  # 0 = sized from the model queues (auto_inflight_limit)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._auto_limit = MAX_AUTO_INFLIGHT
        self._auto_at_ns = 0
        self.shm = shm
        self.strict_readiness = strict_readiness
        self.model_control_mode = model_control_mode
        self.live_flag = True
        self.shutting_down = False
        self._outputs = ResponseAssembler()
        self._touch: Callable[[str], None] | None = getattr(repository, "touch", None)  # LRU residency
        self._log_settings = LogSettings()

    # -- health and metadata ------------------------------------------------------------------
    def live(self) -> bool:
        return self.live_flag

    def ready(self) -> bool:
        if self.shutting_down or not self.live_flag:
            return False
        return self.repository.all_ready() if self.strict_readiness else True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "edgeserve", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_ready(self, name: str, version: str = "") -> bool:
        return self.repository.is_ready(name, version)

    def model_config(self, name: str, version: str = "") -> ModelConfig:
        return self.repository.config(name, version)

    async def config_for_request(self, name: str, version: str = "") -> ModelConfig:
        """The config a frontend needs to decode a request (raw binary HTTP bodies): a
        load-on-first-use or budget-evicted model is loaded first, as `submit` would."""
        try:
            return self.model_config(name, version)
        except InferenceError as exc:
            start = getattr(self.repository, "load_on_demand", None)
            if start is None or exc.status not in (Status.UNAVAILABLE, Status.NOT_FOUND):
                raise
            loading = start(name, version, 0.0)
            if loading is None:
                raise
        await asyncio.wrap_future(loading)
        return self.model_config(name, version)

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        served = self.repository.get(name, version)
        config = served.config
        batch_prefix = [-1] if config.max_batch_size > 0 else []
        if version:
            versions = [str(served.version)]
        else:
            versions = [str(s.version) for s in self.repository.ready_versions(name)]

        def tensors(entries: Any) -> list[dict[str, Any]]:
            return [
                {
                    "name": t.name,
                    "datatype": validation.config_datatype(t.data_type),
                    "shape": batch_prefix + [int(d) for d in t.dims],
                }
                for t in entries
            ]

        return {
            "name": served.name,
            "versions": versions,
            "platform": config.platform or config.backend,
            "inputs": tensors(config.input),
            "outputs": tensors(config.output),
        }

    # -- admission ---------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered, all frontends together."""
        return self._inflight

    def inflight_limit(self) -> int:
        if self.max_inflight > 0:
            return self.max_inflight
        now = time.monotonic_ns()
        if now - self._auto_at_ns >= _AUTO_REFRESH_NS:
            self._auto_at_ns = now
            self._auto_limit = self.auto_inflight_limit()
        return self._auto_limit

    def auto_inflight_limit(self) -> int:
        """AUTO_INFLIGHT_FACTOR x what the served models' queues take (a model whose soft cap is not
        measured yet counts MIN_AUTO_INFLIGHT), between MIN_AUTO_INFLIGHT and MAX_AUTO_INFLIGHT."""
        total = 0
        try:
            served = self.repository.served()
        except Exception:  # a repository in the middle of a reload: keep the last figure
            return self._auto_limit
        for model in served:
            cap = int(getattr(model.scheduler, "soft_queue_cap", 0) or MIN_AUTO_INFLIGHT)
            instances = int(getattr(model.scheduler, "instance_count", 1) or 1)
            total += cap + instances * max(1, int(model.config.max_batch_size))
        return max(MIN_AUTO_INFLIGHT, min(MAX_AUTO_INFLIGHT, AUTO_INFLIGHT_FACTOR * total))

    def admit(self, model: str = "", version: str = "", client: str | None = None) -> None:
        """Count one request in flight, or raise UNAVAILABLE at once when the server holds its limit
        (`[server] max_inflight`) or when `model`'s queue is full for this client (CURRENT_CLIENT
        unless `client` is given). Call before reading/decoding the request's tensors; the request
        must then reach `submit`/`infer` with `admitted=True`, or the caller calls `release()`."""
        if self.shutting_down:
            raise unavailable("server is shutting down")
        if model:
            self._refuse_if_queue_full(model, version, client)
        limit = self.inflight_limit()
        with self._inflight_lock:
            if self._inflight >= limit:
                inflight = self._inflight
            else:
                self._inflight += 1
                return
        raise unavailable(
            f"server overloaded: {inflight} requests in flight (limit {limit}, [server] max_inflight); "
            "retry later"
        )

    def release(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1

    def _refuse_if_queue_full(self, model: str, version: str, client: str | None) -> None:
        # Under overload most requests are refused: refusing them before their body is read and
        # decoded keeps the frontends' CPU for the requests that are served.
        try:
            scheduler = self.repository.get(model, version).scheduler
        except Exception:  # unknown model, bad version: the normal path answers with the reason
            return
        refuses = getattr(scheduler, "refuses", None)
        if refuses is not None and refuses(CURRENT_CLIENT.get() if client is None else client):
            raise unavailable(QUEUE_FULL_MESSAGE)

    # -- inference --------------------------------------------------------------------------------
    async def infer(
        self, request: InferRequest, *, admitted: bool = False, inline_max_ns: int = 0
    ) -> InferResponse:
        """`inline_max_ns`: as `submit`'s, on the event loop: keep it to tens of µs (the loop waits)."""
        answer = LoopAnswer(asyncio.get_running_loop())
        self.submit(request, answer.deliver, admitted=admitted, inline_max_ns=inline_max_ns)
        result, answer.result = answer.result, None
        if result is None:  # queued: a worker answers through the loop
            future: asyncio.Future[InferResponse] = answer.loop.create_future()
            answer.future = future
            try:
                return await future
            finally:
                answer.future = None  # the answer may outlive the call (held by a step's job)
        if isinstance(result, InferenceError):  # refused before queueing
            raise result
        return result  # ran inline: no suspension, no future

    def submit(
        self,
        request: InferRequest,
        on_done: ResponseCallback,
        *,
        inline_max_ns: int = 0,
        admitted: bool = False,
        on_demand: bool = True,
        stream: ResponseStream | None = None,
    ) -> bool:
        """Queue `request`; `on_done` is called once, on a worker thread or (for errors found
        before queueing) right here, with the response or an InferenceError.

        `inline_max_ns` > 0: run the request right here when an instance is idle and the model's
        recent compute time is under it (`Scheduler.try_run_inline`). A frontend on its own thread
        may allow milliseconds; one on the event loop only tens of µs, as the loop waits meanwhile.
        Returns True when it ran here.

        `on_demand`: a request for a model that is not loaded but loads on first use (or was unloaded
        for the memory budget) loads it and waits for it (at most its timeout), then runs.

        `admitted`: the caller already counted the request in flight (`admit()`); otherwise it is
        admitted here. Either way it leaves the in-flight count when `on_done` is called.

        `stream` (from `submit_stream`): a decoupled model's responses go there; without it a
        decoupled model is refused with Triton's error (unary ModelInfer, HTTP /infer)."""
        if not admitted:
            try:
                self.admit()
            except InferenceError as exc:
                on_done(exc)
                return False
        first_on_done = on_done
        answered = [False]

        def release_once() -> None:
            if not answered[0]:
                answered[0] = True
                self.release()

        def releasing(result: InferResponse | InferenceError) -> None:
            release_once()
            first_on_done(result)

        on_done = releasing
        if self.shutting_down:
            on_done(unavailable("server is shutting down"))
            return False
        leases: list[ShmLease] = []
        output_leases: dict[str, ShmLease] = {}
        served: ServedModelLike | None = None
        try:
            served = self.repository.get(request.model_name, request.model_version)
            label = served.name
            if self._touch is not None:
                self._touch(label)
            decoupled = bool(served.config.model_transaction_policy.decoupled)
            if decoupled and stream is None:
                raise decoupled_error()
            for tensor in request.inputs:
                if tensor.shm is not None:
                    if tensor.data is not None:
                        raise invalid_arg(f"input '{tensor.name}' has both shared memory and inline data")
                    lease = self.shm.acquire(tensor.shm, client=request.shm_client)
                    leases.append(lease)
                    # A sealed region is read in place (zero copy); any other is copied out once
                    # with pread, so a client truncating its file gets an error, not a server SIGBUS.
                    tensor.data = datatypes.from_buffer(
                        lease.read(), tensor.datatype, tuple(tensor.shape), f"input '{tensor.name}'"
                    )
            inputs, batch_size = validation.validated_inputs(request, served.config, label)
            output_names = validation.requested_output_names(request, served.config, label)
            # Output regions are resolved now, as Triton does: a bad reference fails before the model
            # runs, and an unregister while the request is in flight cannot pull the region away.
            for wanted in request.outputs or ():
                if wanted.shm is not None:
                    lease = self.shm.acquire(wanted.shm, write=True, client=request.shm_client)
                    leases.append(lease)
                    output_leases[wanted.name] = lease
        except InferenceError as exc:
            for lease in leases:
                lease.release()
            if served is not None:
                served.stats.record_fail(time.monotonic_ns() - request.arrival_ns)
            elif on_demand and self._load_first(exc, request, first_on_done, on_done, stream):
                return False  # submitted again once the model serves
            on_done(exc)
            return False
        except Exception as exc:  # never let a decoding bug take the frontend down
            for lease in leases:
                lease.release()
            log.exception("request %s rejected by an internal error", request.id)
            on_done(internal(f"internal error preparing request: {exc}"))
            return False

        model = served

        def build(result: Arrays | BaseException) -> InferResponse | InferenceError:
            try:
                if isinstance(result, BaseException):
                    return result if isinstance(result, InferenceError) else internal(str(result))
                return self._outputs.response(request, model, result, output_names, output_leases)
            except InferenceError as exc:
                return exc
            except Exception as exc:
                log.exception("building the response for request %s failed", request.id)
                return internal(f"internal error building the response: {exc}")

        def release_leases() -> None:
            # Drop this request's references to the client's memory (a thread's stale local can keep
            # a finished request alive), so an unregistered region's mapping goes now: a region
            # leased here, or a ring slot a frontend read in place under a lease of its own (its
            # tensors are the frontend's to clear).
            inputs.clear()
            if leases:
                for tensor in request.inputs:
                    tensor.data = None
            for lease in leases:
                lease.release()

        def job_done(result: Arrays | BaseException) -> None:
            try:
                on_done(build(result))
            finally:
                release_leases()

        def respond(result: Arrays | BaseException | None, final: bool) -> None:
            """A decoupled model's responses (scheduling/decoupled.py), into `stream`, in order."""
            assert stream is not None
            if not final:
                if result is not None:
                    stream.put(build(result), False)
            elif result is not None:
                job_done(result)
            else:  # the final flag alone
                release_once()
                release_leases()
                stream.put(None, True)

        cache = self.response_cache
        ticket = cache.begin(model, request.parameters, inputs, output_names) if cache is not None else None
        if ticket is not None and ticket.outputs is not None:  # a hit: answered here, no scheduler
            model.stats.record_cache_hit(time.monotonic_ns() - request.arrival_ns, ticket.lookup_ns)
            job_done(ticket.outputs)
            return False
        job = Job(
            inputs=inputs,
            batch_size=batch_size,
            done=job_done if ticket is None else ticket.wrap(job_done),
            priority=int(request.priority),
            timeout_us=int(request.timeout_us),
            arrival_ns=request.arrival_ns,
            request_id=request.id,
            parameters=request.parameters,
            outputs=tuple(output_names),
            on_response=respond if decoupled else None,
        )
        if decoupled:
            job.done = lambda result: respond(result, True)
        cancel = getattr(model.scheduler, "cancel", None)
        if stream is not None and cancel is not None:
            stream.on_cancel(lambda: cancel([job]))
        try:
            if inline_max_ns and model.scheduler.try_run_inline(job, inline_max_ns):
                return True
            model.scheduler.submit(job)
        except InferenceError as exc:
            for lease in leases:
                lease.release()
            if on_demand and self._load_first(exc, request, first_on_done, on_done, stream):
                return False  # its model was being unloaded for memory: runs once loaded again
            on_done(exc)
        return False

    def submit_stream(
        self, request: InferRequest, notify: Callable[[ResponseStream], None], *, admitted: bool = False,
        inline_max_ns: int = 0,
    ) -> ResponseStream:  # fmt: skip
        """Submit `request` for 0..N responses (any model: one that is not decoupled answers once,
        final). The frontend takes them from the stream when `notify(stream)` is called (on the
        producing thread, maybe before this returns: hand it to your own) and calls its `cancel()`
        when its client goes away. `inline_max_ns` as `submit`'s (a decoupled model never runs inline:
        its sends may wait on the reader)."""
        capacity, stall_s = self._stream_bounds(request)
        stream = ResponseStream(notify, capacity, stall_s)

        def final(result: InferResponse | InferenceError) -> None:
            stream.put(result, True)

        self.submit(request, final, admitted=admitted, stream=stream, inline_max_ns=inline_max_ns)
        return stream

    def _stream_bounds(self, request: InferRequest) -> tuple[int, float]:
        try:
            return stream_bounds(self.repository.get(request.model_name, request.model_version).config)
        except Exception:  # an unknown model: `submit` answers why; any bounds do
            return stream_bounds(None)

    def _load_first(
        self, error: InferenceError, request: InferRequest, retry_done: ResponseCallback,
        on_done: ResponseCallback, stream: ResponseStream | None = None,
    ) -> bool:  # fmt: skip
        """Start (or join) the load of a load-on-first-use / evicted model; the request is submitted
        again when it serves, or answered UNAVAILABLE. False: not such a model, answer `error` now."""
        start = getattr(self.repository, "load_on_demand", None)
        if start is None or error.status not in (Status.UNAVAILABLE, Status.NOT_FOUND):
            return False
        loading = start(request.model_name, request.model_version, request.timeout_us / 1e6)
        if loading is None:
            return False

        def loaded(future: concurrent.futures.Future[None]) -> None:
            failure = unavailable("model load cancelled") if future.cancelled() else future.exception()
            if failure is None:
                for tensor in request.inputs:  # shm inputs are resolved again
                    if tensor.shm is not None:
                        tensor.data = None
                self.submit(request, retry_done, admitted=True, on_demand=False, stream=stream)
            else:
                on_done(failure if isinstance(failure, InferenceError) else internal(str(failure)))

        loading.add_done_callback(loaded)
        return True

    def log_settings(self, updates: dict[str, Any] | None = None) -> dict[str, Any]:
        """Triton's log settings; `updates` (all or nothing) change the real logging levels/format."""
        if updates:
            return self._log_settings.update(updates)
        return self._log_settings.get()

    # -- statistics and repository --------------------------------------------------------------
    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            if version:
                models = [self.repository.get(name, version)]
            else:
                models = self.repository.ready_versions(name)
                if not models:
                    self.repository.get(name)  # raises the right NOT_FOUND/UNAVAILABLE
        else:
            models = self.repository.served()
        return {"model_stats": [m.stats.to_dict() for m in models]}

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.repository.index(ready_only)

    def _check_control(self) -> None:
        if self.model_control_mode == "none":
            raise InferenceError(
                Status.UNSUPPORTED,
                "explicit model load / unload is not allowed if polling is enabled or model control mode "
                'is none; set [server] model_control_mode = "explicit"',
            )

    async def load_model(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        self._check_control()
        await self.repository.load(name, config_json, files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_control()
        await self.repository.unload(name, unload_dependents)
