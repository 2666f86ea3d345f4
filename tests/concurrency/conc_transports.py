"""One client thread's own connection to the server: HTTP (tritonclient.http, binary or JSON
tensors), gRPC unary and gRPC stream (tritonclient.grpc), ZeroMQ with inline tensors and ZeroMQ
through the shared-memory frame ring (edgeserve.client: inputs copied into ring slots, outputs
written by the server into ring slots). conc_shared.py has the wires shared by many threads;
conc_wires.py names them all.

`Transport.run(calls, pipelined)` answers every call with an `Answer` (outputs, or the error text),
never raises for a failed request. Pipelined: all calls are in flight at once where the wire allows
it (gRPC stream, ZeroMQ); HTTP and unary gRPC send them one after the other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from edgeserve.client import ClientError, FrameRing, ZmqClient

Array = npt.NDArray[Any]
REQUEST_TIMEOUT_S = 120.0  # generous: a lost answer shows as "lost", a slow shared box is no failure
# Wires whose clients take a deadline per call: there a call may give up early (DEADLINE_EXCEEDED) and
# its late answer must never reach a later call.
DEADLINE_WIRES = frozenset({"grpc", "grpc_aio", "zmq", "zmq_ring", "zmq_aio"})
LATE_ANSWER_S = 10.0  # how long a client waits for the late answers of calls that gave up
RING_SLOTS = 128
RING_SLOT_SIZE = 4096


@dataclass(frozen=True)
class Endpoints:
    http_url: str  # host:port
    grpc_url: str
    zmq_endpoint: str


@dataclass
class Call:
    model: str
    inputs: dict[str, Array]
    outputs: list[str]
    request_id: str
    version: str = ""
    sequence_id: int | str = 0
    start: bool = False
    end: bool = False
    binary: bool = True  # HTTP: binary tensors or JSON
    timeout_s: float | None = None  # a short client deadline (wires in DEADLINE_WIRES); None: the default

    def describe(self) -> str:
        where = f"{self.model}" + (f" v{self.version}" if self.version else "")
        if self.sequence_id:
            flags = "".join(f for f, on in (("S", self.start), ("E", self.end)) if on)
            where += f" seq {self.sequence_id!r}{' ' + flags if flags else ''}"
        return where


@dataclass
class Answer:
    outputs: dict[str, Array] | None = None
    error: str | None = None
    response_id: str | None = None  # None where the wire carries no request id back (ZeroMQ)
    wire_id: str | None = None  # ZeroMQ: the client's own id of the request, which the reply names
    model_version: str | None = None
    lost: bool = False


@dataclass
class _StreamBatch:
    ids: set[str]
    answers: dict[str, Answer] = field(default_factory=dict)
    unmatched: list[Answer] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def sequence_kwargs(call: Call) -> dict[str, Any]:
    if not call.sequence_id:
        return {}
    return {"sequence_id": call.sequence_id, "sequence_start": call.start, "sequence_end": call.end}


def failure(exc: BaseException) -> Answer:
    return Answer(error=f"{type(exc).__name__}: {exc}")


def _datatype(array: Array) -> str:
    return str(np_to_triton_dtype(array.dtype))


class Transport:
    name = ""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        raise NotImplementedError

    def leaks(self) -> str | None:
        """What this client still holds that it should have got back (checked before close)."""
        return None

    def close(self) -> None:
        pass


class HttpTransport(Transport):
    name = "http"

    def __init__(self, endpoints: Endpoints) -> None:
        self.client = httpclient.InferenceServerClient(
            endpoints.http_url, connection_timeout=REQUEST_TIMEOUT_S, network_timeout=REQUEST_TIMEOUT_S
        )

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        return [self._one(call) for call in calls]

    def _one(self, call: Call) -> Answer:
        request = http_request(call, httpclient)
        try:
            result = self.client.infer(**request)
        except Exception as exc:
            return failure(exc)
        return http_answer(result, call.outputs)

    def close(self) -> None:
        self.client.close()


def http_request(call: Call, module: Any) -> dict[str, Any]:
    """infer()'s arguments for `call`, for tritonclient.http or tritonclient.http.aio."""
    inputs = []
    for name, array in call.inputs.items():
        tensor = module.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array, binary_data=call.binary)
        inputs.append(tensor)
    outputs = [module.InferRequestedOutput(n, binary_data=call.binary) for n in call.outputs]
    return _request(call, inputs, outputs)


def _request(call: Call, inputs: list[Any], outputs: list[Any]) -> dict[str, Any]:
    return {
        "model_name": call.model,
        "inputs": inputs,
        "model_version": call.version,
        "outputs": outputs,
        "request_id": call.request_id,
        **sequence_kwargs(call),
    }


def http_answer(result: Any, names: Sequence[str]) -> Answer:
    response = result.get_response()
    return Answer(
        {n: result.as_numpy(n) for n in names},
        response_id=str(response.get("id", "")),
        model_version=str(response.get("model_version", "")),
    )


def grpc_inputs(call: Call) -> list[Any]:
    inputs = []
    for name, array in call.inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_request(call: Call) -> dict[str, Any]:
    """infer()'s arguments for `call`, for tritonclient.grpc or tritonclient.grpc.aio."""
    request = _request(call, grpc_inputs(call), [grpcclient.InferRequestedOutput(n) for n in call.outputs])
    return {**request, "client_timeout": call.timeout_s or REQUEST_TIMEOUT_S}


def grpc_answer(result: Any, names: Sequence[str]) -> Answer:
    response = result.get_response()
    return Answer(
        {n: result.as_numpy(n) for n in names}, response_id=response.id, model_version=response.model_version
    )


class GrpcTransport(Transport):
    name = "grpc"

    def __init__(self, endpoints: Endpoints) -> None:
        self.client = grpcclient.InferenceServerClient(endpoints.grpc_url)

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        answers = []
        for call in calls:
            try:
                result = self.client.infer(**grpc_request(call))
            except Exception as exc:
                answers.append(failure(exc))
                continue
            answers.append(grpc_answer(result, call.outputs))
        return answers

    def close(self) -> None:
        self.client.close()


class GrpcStreamTransport(Transport):
    """One bidirectional stream for the client's life; answers matched by request id. An error on
    the stream carries no id (tritonclient drops it), so errors go to the calls left unanswered."""

    name = "grpc_stream"

    def __init__(self, endpoints: Endpoints) -> None:
        self.client = grpcclient.InferenceServerClient(endpoints.grpc_url)
        self._lock = threading.Lock()
        self._batch: _StreamBatch | None = None
        self._names: dict[str, list[str]] = {}
        self.client.start_stream(callback=self._on_answer)

    def _on_answer(self, result: Any, error: Any) -> None:
        with self._lock:
            batch = self._batch
            if batch is None:
                return
            if error is not None:
                batch.unmatched.append(Answer(error=f"{type(error).__name__}: {error}"))
            else:
                rid = result.get_response().id
                answer = grpc_answer(result, self._names.get(rid, []))
                if rid in batch.ids and rid not in batch.answers:
                    batch.answers[rid] = answer
                else:
                    batch.unmatched.append(answer)
            if len(batch.answers) + len(batch.unmatched) >= len(batch.ids):
                batch.done.set()

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        if not pipelined:
            return [a for call in calls for a in self._send([call])]
        return self._send(calls)

    def _send(self, calls: Sequence[Call]) -> list[Answer]:
        batch = _StreamBatch({c.request_id for c in calls})
        with self._lock:
            self._batch = batch
            self._names = {c.request_id: c.outputs for c in calls}
        for call in calls:
            outputs = [grpcclient.InferRequestedOutput(n) for n in call.outputs]
            self.client.async_stream_infer(
                call.model,
                grpc_inputs(call),
                model_version=call.version,
                outputs=outputs,
                request_id=call.request_id,
                **sequence_kwargs(call),
            )
        batch.done.wait(REQUEST_TIMEOUT_S)
        with self._lock:
            self._batch = None
            answers, unmatched = dict(batch.answers), list(batch.unmatched)
        out = []
        for call in calls:
            if call.request_id in answers:
                out.append(answers[call.request_id])
            elif unmatched:
                out.append(unmatched.pop(0))
            else:
                out.append(Answer(error=f"no answer on the stream in {REQUEST_TIMEOUT_S:g} s", lost=True))
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, endpoints: Endpoints) -> None:
        self.client = ZmqClient(endpoints.zmq_endpoint, timeout=REQUEST_TIMEOUT_S)
        self.ring: FrameRing | None = None

    def _submit(self, call: Call) -> Any:
        params: dict[str, Any] = {}
        if call.sequence_id:
            params = {"sequence_id": call.sequence_id, "sequence_start": call.start, "sequence_end": call.end}
        outputs: Any = call.outputs
        if self.ring is not None:
            outputs = {n: self.ring for n in call.outputs}
        return self.client.submit(
            call.model,
            call.inputs,
            outputs,
            version=call.version,
            ring=self.ring,
            parameters=params or None,
            timeout=call.timeout_s,
        )

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        if not pipelined:
            return [self._wait(call, self._submit_safe(call)) for call in calls]
        futures = [self._submit_safe(call) for call in calls]
        return [self._wait(call, future) for call, future in zip(calls, futures, strict=True)]

    def _submit_safe(self, call: Call) -> Any:
        try:
            return self._submit(call)
        except ClientError as exc:
            return exc

    def _wait(self, call: Call, future: Any) -> Answer:
        if isinstance(future, ClientError):
            return Answer(error=f"submit: {future!r}")
        try:
            result = future.result()
        except TimeoutError as exc:
            return Answer(error=f"no answer: {exc}", lost=True)
        except ClientError as exc:
            lost = "timed out" in str(exc).lower()
            return Answer(error=f"{exc.status}: {exc}", lost=lost)
        # Copies: ring outputs are copies already; inline ones are views of the reply frames.
        return Answer(
            {n: np.array(result.as_numpy(n)) for n in call.outputs},
            model_version=str(result.model_version),
            wire_id=str(result.id),
        )

    def close(self) -> None:
        self.client.close()


class ZmqRingTransport(ZmqTransport):
    name = "zmq_ring"

    def __init__(self, endpoints: Endpoints) -> None:
        super().__init__(endpoints)
        self.ring = self.client.create_ring(slots=RING_SLOTS, slot_size=RING_SLOT_SIZE)

    def run(self, calls: Sequence[Call], pipelined: bool) -> list[Answer]:
        # A call holds a slot per input and per output until its answer: keep that within the ring,
        # and wait for the slots of earlier calls (late answers of calls that gave up free theirs).
        per_call = max(len(c.inputs) + len(c.outputs) for c in calls) if calls else 1
        chunk = max(1, RING_SLOTS // per_call) if pipelined else 1
        answers: list[Answer] = []
        for first in range(0, len(calls), chunk):
            part = calls[first : first + chunk]
            self._wait_for_slots(per_call * len(part), LATE_ANSWER_S)
            answers += super().run(part, pipelined)
        return answers

    def _wait_for_slots(self, count: int, timeout_s: float) -> bool:
        """Receive replies (which free slots) until `count` slots are free, up to `timeout_s`."""
        assert self.ring is not None
        deadline = time.monotonic() + timeout_s
        while self.ring.free < count and time.monotonic() < deadline:
            self.client.poll(0.01)
        return self.ring.free >= count

    def leaks(self) -> str | None:
        """Every slot comes back once nothing is in flight (late answers included; waits for them)."""
        assert self.ring is not None
        if self._wait_for_slots(RING_SLOTS, LATE_ANSWER_S):
            return None
        return (
            f"{RING_SLOTS - self.ring.free} of the ring's {RING_SLOTS} slots never came back with "
            f"nothing in flight ({self.client.in_flight} requests pending) {LATE_ANSWER_S:g} s after "
            "the last call; calls that gave up on a deadline had used them"
        )
