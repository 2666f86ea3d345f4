"""The server's side of one worker's event channel (channel.py): what the model starts.

- `resp` (a decoupled response) goes to its request's ResponseSink, its tensors copied out of the
  worker's half (the sink keeps them); the answer frees the worker's block and tells whether the
  request was cancelled. A response for a request that already ended reaches nobody (logged).
- `cancelled` answers `request.is_cancelled()` from the sink.
- `bls` becomes an InferRequest on the data plane (`streams.current_caller()`), its inputs views of
  the worker's half, or read-only views of its per-call region when the worker passes an input of
  the running execute call on by reference (callref.py; checked: a forged one is INVALID_ARG); each
  result's tensors are written into the server's half and named in
  the answer (the worker copies them out and frees them with `free`). A quick model may run on this
  reader thread (server/bls.py); its answer then never waits here for room in the server's half
  (the frees come through this thread): a full half hands it to a thread. A call chain deeper than
  MAX_CHAIN, or a call into a model on its own chain whose instances are all busy in it (it would wait
  for itself), is refused with an error that says so.
- `family` / `series` / `metric` / `value` go to the server's custom-metrics registry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edgeserve.backends import streams
from edgeserve.backends.python import callref, wire
from edgeserve.backends.python.channel import ALLOC_WAIT_S, ArenaBusy, ArenaFull, Channel, ChannelClosed
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from edgeserve.backends.streams import ResponseSink

log = logging.getLogger("edgeserve.backends.python")

MAX_CHAIN = 16  # models on one BLS call chain
_instances: dict[str, int] = {}  # model -> live Python instances (a chain may use that many of it)
_instances_lock = threading.Lock()
_TRITON_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                 "ALREADY_EXISTS", "CANCELLED")  # fmt: skip


def count_instance(model: str, delta: int) -> None:
    with _instances_lock:
        _instances[model] = _instances.get(model, 0) + delta
        if _instances[model] <= 0:
            del _instances[model]


def _status(name: Any) -> Status:
    try:
        return Status(str(name))
    except ValueError:
        return Status.INTERNAL


def _triton_code(status: Status) -> str:
    return status.value if status.value in _TRITON_CODES else "INTERNAL"


class Events:
    """Dispatches one worker's event messages (on the channel's reader thread)."""

    def __init__(
        self, channel: Channel, model: str, label: str, call_region: wire.Region | None = None
    ) -> None:
        self.channel = channel
        self.call_region = call_region  # the worker's per-call region: BLS inputs by reference (callref.py)
        self.model = model
        self.label = label
        self._sinks: dict[int, ResponseSink] = {}
        self._calls: dict[int, Callable[[], None]] = {}  # BLS question -> cancel
        self._lock = threading.Lock()
        self._next = 0
        channel.handler = self._handle
        channel.on_close = self._closed
        channel.start()

    # -- decoupled requests ---------------------------------------------------------------------------
    def open(self, sinks: Sequence[ResponseSink]) -> list[int]:
        """Register one execute call's sinks; their numbers for the worker."""
        with self._lock:
            for rid, sink in list(self._sinks.items()):  # a request the model never ended, now gone
                if sink.cancelled:
                    del self._sinks[rid]
            numbers = []
            for sink in sinks:
                self._next += 1
                self._sinks[self._next] = sink
                numbers.append(self._next)
        return numbers

    def fail(self, rids: Sequence[int], error: InferenceError) -> None:
        """End the requests of `rids` that are still open with `error` (execute failed)."""
        for rid in rids:
            with self._lock:
                sink = self._sinks.pop(rid, None)
            if sink is not None:
                self._end(sink, error)

    def _end(self, sink: ResponseSink, error: InferenceError) -> None:
        with contextlib.suppress(InferenceError):
            sink.send(None, final=True, error=error)

    def _closed(self) -> None:
        """The worker went: every open request ends with an error, every BLS call is cancelled."""
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        error = InferenceError(
            Status.INTERNAL, f"{self.label}: the Python worker ended before the final response"
        )
        for sink in sinks:
            self._end(sink, error)
        for cancel in calls:
            try:
                cancel()
            except Exception:
                log.exception("%s: cancelling a BLS call failed", self.label)

    def _response(self, message: wire.Header) -> None:
        rid = int(message.get("r", 0))
        final = bool(message.get("final"))
        with self._lock:
            sink = self._sinks.pop(rid, None) if final else self._sinks.get(rid)
        if sink is None:
            log.error("%s: a response for a request that has ended (sent after the final flag?): dropped",
                      self.label)  # fmt: skip
            self.channel.answer(message, {"cancelled": True})
            return
        error = None
        outputs = None
        try:
            if "error" in message:
                error = InferenceError(_status(message.get("status")), str(message["error"]))
            elif message.get("outputs"):
                outputs = self.channel.read(list(message["outputs"]), copy=True)
            elif not final:
                outputs = {}
        except (ValueError, KeyError, TypeError, InferenceError) as exc:
            error = InferenceError(Status.INTERNAL, f"{self.label}: a bad response: {exc}")
        try:
            sink.send(outputs, final=final, error=error)
        except InferenceError as exc:
            log.error("%s: %s", self.label, exc.message)
        self.channel.answer(message, {"cancelled": sink.cancelled})

    # -- the dispatcher -------------------------------------------------------------------------------
    def _handle(self, message: wire.Header) -> None:
        op = message.get("op")
        try:
            if op == "resp":
                self._response(message)
            elif op == "cancelled":
                with self._lock:
                    sink = self._sinks.get(int(message.get("r", 0)))
                self.channel.answer(message, {"cancelled": sink is None or sink.cancelled})
            elif op == "free":
                self.channel.arena.free(int(message["o"]))
            elif op == "failed":
                error = InferenceError(
                    _status(message.get("status")), f"{self.label}: {message.get('error')}"
                )
                self.fail([int(r) for r in message.get("r", [])], error)
            elif op == "bls":
                self._bls(message)
            elif op in ("family", "series", "metric", "value"):
                self._metric(str(op), message)
            else:
                self.channel.answer(message, {"error": f"unknown event {op!r}"})
        except ChannelClosed:
            pass
        except Exception as exc:  # a malformed message from user code's process: answer, keep going
            log.warning("%s: a bad event message (%s): %s", self.label, op, exc)
            with contextlib.suppress(ChannelClosed):
                self.channel.answer(message, {"error": f"a bad {op} message: {exc}", "status": "INVALID_ARG"})

    # -- BLS ------------------------------------------------------------------------------------------
    def _refusal(self, target: str, chain: list[str]) -> str | None:
        if len(chain) >= MAX_CHAIN:
            return f"the BLS call chain {' -> '.join(chain)} -> {target} is deeper than {MAX_CHAIN} models"
        with _instances_lock:
            instances = _instances.get(target, 0)
        on_chain = chain.count(target)
        if on_chain and on_chain >= instances:
            return (
                f"BLS call from model '{self.model}' to model '{target}' would wait for itself: "
                f"'{target}' is on the call chain {' -> '.join(chain)} and its {instances} instance(s) "
                "are busy in it (give it more instances, or do not call it recursively)"
            )
        return None

    def _bls(self, message: wire.Header) -> None:
        from edgeserve.protocol.inference import InferRequest, InputTensor, RequestedOutput

        target = str(message.get("model", ""))
        chain = [c for c in str(message.get("chain", "")).split(",") if c] or [self.model]
        caller = streams.current_caller()
        refusal = self._refusal(target, chain)
        if caller is None or refusal is not None:
            text = refusal or "BLS needs the server's data plane, which is not running in this process"
            self.channel.answer(
                message, {"error": text, "status": "INVALID_ARG" if refusal else "UNAVAILABLE"}
            )
            return
        heads = {str(h["n"]): h for h in message.get("inputs") or []}
        by_ref = {n: h for n, h in heads.items() if callref.is_reference(h)}
        try:
            tensors = {n: callref.resolve(self.call_region, h) for n, h in by_ref.items()}
        except InferenceError as exc:  # a forged reference (the worker runs user code): the caller's error
            self.channel.answer(message, {"error": exc.message, "status": "INVALID_ARG"})
            return
        tensors.update(self.channel.read([h for n, h in heads.items() if n not in by_ref], copy=False))
        inputs = [InputTensor(n, str(heads[n]["t"]), tuple(a.shape), data=a) for n, a in tensors.items()]
        parameters = _parameters(message, chain)
        request = InferRequest(
            model_name=target, model_version=str(message.get("version", "") or ""),
            id=str(message.get("id", "")),
            inputs=inputs, outputs=[RequestedOutput(str(n)) for n in message.get("outputs") or []] or None,
            parameters=parameters, timeout_us=max(0, int(message.get("timeout_us", 0) or 0)),
        )  # fmt: skip
        number = int(message["q"])
        ended = [False]  # the final result came (maybe inline, before `call` returned)

        def on_result(result: Any, final: bool) -> None:
            if final:
                with self._lock:
                    ended[0] = True
                    self._calls.pop(number, None)
            if self.channel.on_reader():
                # Run inline (server/bls.py): the frees that make room in my half come through this
                # thread, so it must not wait for them; a full half hands the answer to a thread.
                try:
                    answer = self._result(result, wait_s=0.0)
                except ArenaBusy:
                    threading.Thread(target=self._answer, args=(message, result, final), daemon=True,
                                     name=f"edgeserve-bls-answer-{self.label}").start()  # fmt: skip
                    return
                with contextlib.suppress(ChannelClosed):
                    self.channel.answer(message, answer, more=not final)
                return
            self._answer(message, result, final)

        cancel = caller.call(request, on_result, caller=self.model)
        with self._lock:
            if not ended[0] and not self.channel.closed.is_set():
                self._calls[number] = cancel

    def _answer(self, message: wire.Header, result: Any, final: bool) -> None:
        with contextlib.suppress(ChannelClosed):
            self.channel.answer(message, self._result(result), more=not final)

    def _result(self, result: Any, wait_s: float = ALLOC_WAIT_S) -> wire.Header:
        """The answer for one result: its tensors written once into my half. ArenaBusy: no room
        now (only with a short `wait_s`)."""
        if isinstance(result, InferenceError):
            return {"error": result.message, "status": _triton_code(result.status)}
        if result is None:
            return {}
        pairs = [(out.name, out.data) for out in result.outputs if out.data is not None]
        try:
            headers, block = self.channel.write(pairs, wait_s)
        except (ArenaFull, ValueError, TypeError) as exc:
            if isinstance(exc, ArenaBusy) and wait_s < ALLOC_WAIT_S:
                raise
            return {"error": f"cannot pass the BLS result to the model: {exc}", "status": "UNAVAILABLE"}
        return {"outputs": headers, "block": block}

    # -- custom metrics -------------------------------------------------------------------------------
    def _metric(self, op: str, message: wire.Header) -> None:
        from edgeserve.custom_metrics import CUSTOM_METRICS, CustomMetricsError

        labels: Mapping[str, str] = message.get("labels") or {}
        try:
            answer: wire.Header = {}
            if op == "family":
                description = str(message.get("description", ""))
                CUSTOM_METRICS.declare_family(self.model, str(message["name"]), description,
                                              str(message.get("kind", "")))  # fmt: skip
            elif op == "series":
                CUSTOM_METRICS.declare_series(
                    self.model, str(message["family"]), labels, message.get("buckets")
                )
            elif op == "value":
                answer = {"value": CUSTOM_METRICS.value(self.model, str(message["family"]), labels)}
            else:
                CUSTOM_METRICS.apply(self.model, str(message.get("do")), str(message["family"]), labels,
                                     float(message.get("value", 0.0)), message.get("buckets"))  # fmt: skip
        except CustomMetricsError as exc:
            if "q" not in message:
                log.error("%s: a custom metric update was refused: %s", self.label, exc)
            answer = {"error": str(exc)}
        self.channel.answer(message, answer)


def _parameters(message: wire.Header, chain: list[str]) -> dict[str, Any]:
    """The request's parameters: the model's own, Triton's sequence fields, and the call chain."""
    params = message.get("params") or {}
    out: dict[str, Any] = {k: v for k, v in params.items() if isinstance(v, (bool, int, float, str))}
    corrid = message.get("corrid") or 0
    flags = int(message.get("flags", 0) or 0)
    if corrid:
        out["sequence_id"] = corrid
        out["sequence_start"] = bool(flags & 1)
        out["sequence_end"] = bool(flags & 2)
    out[wire.CHAIN_PARAMETER] = ",".join(chain)
    return out
