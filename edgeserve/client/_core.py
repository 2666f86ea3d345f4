"""Message building and reply parsing shared by the sync and asyncio ZeroMQ clients."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import zmq

from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing, ShmTensor, Slot
from edgeserve.frontends.zmq import wire
from edgeserve.logs import safe
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError

STATUS_MAX, MESSAGE_MAX = 64, 1000  # characters of a server's status and message kept in a ClientError
InputValue: TypeAlias = "npt.NDArray[Any] | ShmTensor"
OutputTarget: TypeAlias = "FrameRing | Slot | ShmTensor | None"
Outputs: TypeAlias = "Sequence[str] | Mapping[str, OutputTarget] | None"


@dataclass
class InferResult:
    """A finished inference: outputs as numpy arrays (views of the reply frames, or copies of ring slots)."""

    model_name: str
    model_version: str
    id: Any
    outputs: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    # Outputs the server wrote into a caller-managed region: name -> {"datatype","shape","shm"}
    shm_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    latency_s: float = 0.0  # send to reply, measured by the client

    def as_numpy(self, name: str) -> npt.NDArray[Any]:
        if name in self.outputs:
            return self.outputs[name]
        if name in self.shm_outputs:
            ref = self.shm_outputs[name]["shm"]
            raise KeyError(
                f"output '{name}' was written to shared memory region '{ref['region']}' "
                f"(offset {ref.get('offset', 0)}, {ref['byte_size']} bytes); read it there"
            )
        raise KeyError(f"no output '{name}' in the result; outputs: {', '.join(self.outputs) or '(none)'}")

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.as_numpy(name)


class Pending:
    """A request in flight: the slots it holds and where its outputs go."""

    __slots__ = ("deadline", "id", "out_slots", "sent_at", "slots")

    def __init__(self, req_id: int) -> None:
        self.id = req_id
        self.slots: list[Slot] = []
        self.out_slots: dict[str, Slot] = {}
        self.sent_at = 0.0
        self.deadline = 0.0

    def release_inputs(self) -> None:
        """Give back the input slots only (the outputs' are still being read)."""
        outs = {id(slot) for slot in self.out_slots.values()}
        kept = []
        for slot in self.slots:
            if id(slot) in outs:
                kept.append(slot)
            else:
                slot.ring.release(slot)
        self.slots = kept

    def release_slots(self, timed_out: bool = False) -> None:
        for slot in self.slots:
            if timed_out:
                slot.ring.quarantine(slot)
            else:
                slot.ring.release(slot)
        self.slots = []


def _ref(tensor: ShmTensor) -> dict[str, Any]:
    slot = tensor.slot
    if slot is not None:
        # wire.shm_ref inlined for the common ring-slot case (the hot path of every request)
        ref: dict[str, Any] = {"region": tensor.region, "byte_size": int(tensor.byte_size)}
        if tensor.offset:
            ref["offset"] = int(tensor.offset)
        ref["slot"] = int(slot.index)
        ref["gen"] = int(slot.gen)
        return ref
    return wire.shm_ref(tensor.region, tensor.byte_size, tensor.offset)


def build_infer(
    pending: Pending,
    model: str,
    inputs: Mapping[str, InputValue],
    outputs: Outputs = None,
    *,
    version: str = "",
    ring: FrameRing | None = None,
    priority: int = 0,
    timeout_us: int = 0,
    parameters: Mapping[str, Any] | None = None,
    copy_inputs: bool = True,
    stream: bool = False,
) -> list[Any]:
    """The frames of one infer request (`stream`: a streamed one, 0..N replies). Slots taken here are
    recorded on `pending`; on error they are given back before raising."""
    try:
        header: dict[str, Any] = {"v": wire.VERSION, "op": wire.OP_INFER, "id": pending.id, "model": model}
        if version:
            header["version"] = str(version)
        if priority:
            header["priority"] = int(priority)
        if timeout_us:
            header["timeout_us"] = int(timeout_us)
        if parameters:
            header["parameters"] = dict(parameters)
        if stream:
            header["stream"] = True
        frames: list[Any] = [b""]
        descs: list[dict[str, Any]] = []
        for name, value in inputs.items():
            if isinstance(value, ShmTensor):
                if value.datatype is None or value.shape is None:
                    raise ClientError(
                        "INVALID_ARG", f"input '{name}': a shared-memory input needs datatype and shape"
                    )
                descs.append(
                    {"name": name, "datatype": value.datatype, "shape": list(value.shape), "shm": _ref(value)}
                )
                if value.slot is not None:
                    pending.slots.append(value.slot)
                continue
            descs.append(_inline(pending, name, value, ring, copy_inputs, frames))
        header["inputs"] = descs
        if outputs is not None:
            header["outputs"] = _outputs(pending, outputs)
        frames[0] = wire.dumps(header)
        return frames
    except BaseException:
        pending.release_slots()
        raise


def _inline(
    pending: Pending, name: str, value: Any, ring: FrameRing | None, copy_inputs: bool, frames: list[Any]
) -> dict[str, Any]:
    """The descriptor of a numpy input: copied into a slot of `ring`, or its bytes appended to `frames`."""
    array = np.asarray(value)
    try:
        datatype = datatypes.from_numpy(array.dtype)
    except InferenceError as exc:
        raise ClientError("INVALID_ARG", f"input '{name}': {exc.message}") from None
    desc: dict[str, Any] = {"name": name, "datatype": datatype, "shape": [int(d) for d in array.shape]}
    if ring is not None:
        slot = ring.acquire()
        pending.slots.append(slot)
        desc["shm"] = _ref(slot.write(array))
    else:
        payload = datatypes.to_wire_bytes(array, datatype)
        if copy_inputs or wire.send_copy(payload):
            payload = bytes(payload)
        frames.append(payload)
    return desc


def _outputs(pending: Pending, outputs: Outputs) -> list[dict[str, Any]]:
    if isinstance(outputs, str):
        raise ClientError("INVALID_ARG", "outputs must be a list of names or a mapping, not a string")
    if not isinstance(outputs, Mapping):
        return [{"name": str(name)} for name in outputs]  # type: ignore[union-attr]
    descs: list[dict[str, Any]] = []
    for name, target in outputs.items():
        desc: dict[str, Any] = {"name": name}
        if isinstance(target, FrameRing):
            target = target.acquire()
            pending.slots.append(target)
        if isinstance(target, Slot):
            desc["shm"] = _ref(target.output())
            pending.out_slots[name] = target
            if target not in pending.slots:
                pending.slots.append(target)
        elif isinstance(target, ShmTensor):
            desc["shm"] = _ref(target)
            if target.slot is not None:
                pending.out_slots[name] = target.slot
                if target.slot not in pending.slots:
                    pending.slots.append(target.slot)
        elif target is not None:
            raise ClientError(
                "INVALID_ARG",
                f"output '{name}': target must be None, a FrameRing, a Slot or a "
                f"ShmTensor, not {type(target).__name__}",
            )
        descs.append(desc)
    return descs


class Registrations:
    """The regions a client registered, so it can register them again after the server restarted
    (a new server process has an empty registry and answers NOT_FOUND for them)."""

    def __init__(self) -> None:
        self.regions: dict[str, dict[str, Any]] = {}
        self.lost: set[str] = set()

    def add(self, name: str, key: str, byte_size: int, offset: int) -> None:
        self.regions[name] = {"name": name, "key": key, "byte_size": byte_size, "offset": offset}
        self.lost.discard(name)

    def remove(self, name: str) -> None:
        names = [name] if name else list(self.regions)
        for each in names:
            self.regions.pop(each, None)
            self.lost.discard(each)

    def note(self, error: ClientError) -> None:
        if error.status == "NOT_FOUND" and "shared memory region" in error.message:
            self.lost.update(n for n in self.regions if f"'{n}'" in error.message)

    def take_lost(self) -> list[dict[str, Any]]:
        lost = [self.regions[n] for n in sorted(self.lost) if n in self.regions]
        self.lost.clear()
        return lost


def build_control(req_id: int, op: str, **fields: Any) -> list[Any]:
    return [wire.dumps({"v": wire.VERSION, "op": op, "id": req_id, **fields})]


def check_status(header: Any) -> None:
    if not isinstance(header, dict):
        raise ClientError("INTERNAL", "reply header is not a JSON object")
    status = header.get("status")
    if status != wire.STATUS_OK:  # the server's words, escaped and capped: they reach logs and terminals
        raise ClientError(safe(status, STATUS_MAX), safe(header.get("message", ""), MESSAGE_MAX))


# (datatype, shape) -> (numpy dtype, byte size) of fixed-size reply tensors
_VIEW_SPEC: dict[tuple[str, tuple[Any, ...]], tuple[np.dtype[Any], int]] = {}
_VIEW_SPEC_MAX = 512


def _view(buffer: Any, datatype: str, shape: tuple[Any, ...], name: str) -> npt.NDArray[Any]:
    """datatypes.from_buffer with its per-call lookups memoised; any miss or mismatch takes
    from_buffer itself, so errors read the same."""
    spec = _VIEW_SPEC.get((datatype, shape))
    if spec is not None:
        dtype, nbytes = spec
        view = memoryview(buffer)
        if view.nbytes == nbytes:
            fast: npt.NDArray[Any] = np.ndarray(shape, dtype, view)  # a view, as from_buffer's, in one call
            return fast
    array = datatypes.from_buffer(buffer, datatype, shape, f"output '{name}'")
    if (
        spec is None
        and datatype != "BYTES"
        and len(_VIEW_SPEC) < _VIEW_SPEC_MAX
        and all(type(d) is int for d in shape)
    ):
        _VIEW_SPEC[datatype, shape] = (array.dtype, array.nbytes)
    return array


def parse_infer(
    header: dict[str, Any], frames: Sequence[Any], pending: Pending, copy: bool = True
) -> InferResult:
    """The result of a reply (outputs copied out of ring slots, or views of them with `copy=False`);
    raises ClientError for an error reply."""
    if header.get("status") != wire.STATUS_OK:
        check_status(header)
    outputs: dict[str, npt.NDArray[Any]] = {}
    shm_outputs: dict[str, dict[str, Any]] = {}
    result = InferResult(
        str(header.get("model", "")),
        str(header.get("version", "")),
        header.get("id"),
        outputs,
        shm_outputs,
        header.get("parameters") or {},
        time.perf_counter() - pending.sent_at,
    )
    index = 0
    try:
        for desc in header.get("outputs", ()):
            name, datatype, shape = desc["name"], desc["datatype"], tuple(desc["shape"])
            if "shm" in desc:
                slot = pending.out_slots.get(name)
                if slot is None:
                    shm_outputs[name] = desc
                else:
                    outputs[name] = slot.ring.read(slot, datatype, shape, int(desc["shm"]["byte_size"]), copy)
                continue
            outputs[name] = _view(frames[index], datatype, shape, name)
            index += 1
    except InferenceError as exc:
        raise ClientError("INTERNAL", f"malformed reply: {safe(exc.message, MESSAGE_MAX)}") from None
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ClientError("INTERNAL", f"malformed reply: {safe(repr(exc), MESSAGE_MAX)}") from None
    return result


def first_request_id() -> int:
    """Where a client's request IDs start: a random point below 2**52 (IDs stay exact in JSON up to
    2**53). A client that reuses a gone client's identity (a restarted process keeping its regions)
    gets the replies still owed to that identity; IDs from another range keep them from answering
    its own requests (they are dropped as unknown)."""
    return secrets.randbits(52) + 1


def dealer_socket(ctx: Any, endpoint: str, identity: bytes, timeout: float) -> Any:
    """The client's DEALER socket, connected: a plain zmq.Socket whatever the context's class (the
    asyncio client watches its FD itself; a zmq.asyncio context would make asyncio sockets)."""
    sock = zmq.Socket(ctx, zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)  # stable across reconnects: keeps our regions
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no server -> send times out instead of queueing forever
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
    sock.connect(endpoint)
    return sock
