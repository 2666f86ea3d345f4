"""Server side of the wire format: header + frames -> `InferRequest`, `InferResponse` -> reply frames.

Inline tensors become numpy views over the received ZeroMQ frames (no copy). Shared-memory
references become `ShmRef`s that the data plane resolves in the shared registry, so a region
registered over gRPC/HTTP is usable here and the other way round. Ring-slot references (with a
slot index and generation) are guarded: see `edgeserve.frontends.shm.ring` for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.frontends.shm.registry import SharedMemoryRegistry, ShmClient, ShmLease
from edgeserve.frontends.shm.ring import GEN, HEADER_SIZE, PAGE, RingLayout
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status, invalid_arg
from edgeserve.protocol.inference import (
    InferRequest,
    InputTensor,
    ParamValue,
    RegionNamer,
    RequestedOutput,
    ShmRef,
    clamp_timeout_us,
)

__all__ = ["Decoded", "OutputSlot", "SlotGuard", "decode_infer"]


class SlotGuard:
    """One ring slot a request uses: keeps the slot's generation word mapped and checks it."""

    __slots__ = ("_at", "_lease", "gen", "region", "slot", "what")

    def __init__(self, lease: ShmLease, at: int, region: str, slot: int, gen: int, what: str) -> None:
        self._lease = lease
        self._at = at  # the generation word's offset in the lease's view
        self.region = region
        self.slot = slot
        self.gen = gen
        self.what = what

    def current(self) -> int:
        return int(GEN.unpack_from(self._lease.view, self._at)[0])

    def check(self, when: str, consequence: str) -> None:
        now = self.current()
        if now != self.gen:
            raise invalid_arg(
                f"{self.what}: slot {self.slot} of ring '{self.region}' was reused {when} (slot generation "
                f"is {now}, the request carries {self.gen}); {consequence}"
            )

    def release(self) -> None:
        self._lease.release()


class OutputSlot:
    """A requested output that goes into a ring slot; written by the frontend after a guard check."""

    __slots__ = ("byte_size", "guard", "lease", "name", "ref")

    def __init__(self, name: str, guard: SlotGuard, lease: ShmLease, ref: dict[str, Any]) -> None:
        self.name = name
        self.guard = guard
        self.lease = lease
        self.ref = ref
        self.byte_size = int(ref["byte_size"])


class Decoded:
    """A decoded request and the ring resources it holds until its reply is built."""

    __slots__ = ("guards", "in_slots", "out_slots", "req_id", "request")

    def __init__(self, req_id: Any, request: InferRequest) -> None:
        self.req_id = req_id
        self.request = request
        self.guards: list[SlotGuard] = []
        self.in_slots: list[InputTensor] = []  # inputs read in place from a slot, under its guard's lease
        self.out_slots: dict[str, OutputSlot] = {}

    def release(self) -> None:
        for tensor in self.in_slots:  # no reference to the client's memory outlives the leases
            tensor.data = None
        self.in_slots = []
        for guard in self.guards:
            guard.release()
        for out in self.out_slots.values():
            out.lease.release()
            out.guard.release()
        self.guards = []
        self.out_slots = {}


# -- field access with clear errors ----------------------------------------------------------------
_MISSING: Any = object()


def _field(
    obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...
) -> Any:
    value = obj.get(key, _MISSING)
    if type(value) is kind:  # the common case: JSON decoders produce exact types
        return value
    if value is _MISSING:
        if default is ...:
            raise invalid_arg(f"{where}: missing field '{key}'")
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise invalid_arg(f"{where}: field '{key}' must be {names}, got {value!r}")
    return value


def _params(obj: dict[str, Any], where: str) -> dict[str, ParamValue]:
    params: dict[str, ParamValue] = _field(obj, "parameters", dict, where, {})
    for key, value in params.items():
        if not isinstance(value, (bool, int, float, str)):
            raise invalid_arg(f"{where}: parameter '{key}' must be a bool, number or string")
    return params


def _shape(desc: dict[str, Any], where: str) -> tuple[int, ...]:
    shape = desc.get("shape")
    if type(shape) is not list:
        shape = _field(desc, "shape", list, where)
    for d in shape:  # JSON gives exact ints (a bool is not one here)
        if type(d) is not int or d < 0:
            raise invalid_arg(f"{where}: shape {shape} must be a list of non-negative integers")
    return tuple(shape)


# Parsed ring headers by their bytes: a ring's header is the same on every request, and its layout
# follows from those 64 bytes alone (a region's size is checked by the registry on each lease).
_LAYOUTS: dict[bytes, RingLayout] = {}
_LAYOUTS_MAX = 256


def _layout(view: Any, region: str) -> RingLayout:
    key = bytes(view[:HEADER_SIZE])
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = RingLayout.parse(view, region, None)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _resolve_ref(
    registry: SharedMemoryRegistry, ref: Any, what: str, client: RegionNamer | None, read: bool = False
) -> tuple[ShmRef, SlotGuard | None, memoryview | None]:
    """A wire reference -> the data plane's ShmRef (+ a guard for ring slots, checked here once).
    `read`: an input's; a slot of a mapped ring comes with a view of its bytes, kept open by the
    guard's lease (the data plane then needs no lease of its own for them)."""
    if not isinstance(ref, dict):
        raise invalid_arg(f"{what}: 'shm' must be an object with region, byte_size and offset")
    region, byte_size, offset = ref.get("region"), ref.get("byte_size"), ref.get("offset", 0)
    if type(region) is not str or type(byte_size) is not int or type(offset) is not int:
        region = _field(ref, "region", str, what)  # the error names the field (or a bool is fine)
        byte_size = _field(ref, "byte_size", int, what)
        offset = _field(ref, "offset", int, what, 0)
    if byte_size < 0 or offset < 0:
        raise invalid_arg(f"{what}: shared memory offset and byte_size must not be negative")
    if "slot" not in ref:
        return ShmRef(region, byte_size, offset), None, None
    slot, gen = ref.get("slot"), ref.get("gen")
    if type(slot) is not int or type(gen) is not int:
        slot = _field(ref, "slot", int, what)
        gen = _field(ref, "gen", int, what)
    # A ring's data starts at a page boundary, so its first page (header and, for up to 504 slots,
    # every generation word) can be mapped with one lease that then guards the slot.
    try:
        lease = registry.acquire(ShmRef(region, PAGE, 0), client=client)
    except InferenceError as exc:
        if exc.status != Status.INVALID_ARG:
            raise
        lease = registry.acquire(ShmRef(region, HEADER_SIZE, 0), client=client)  # too small: say why below
    try:
        view = lease.view
        layout = _layout(view, region)
        start = layout.locate(region, slot, offset, byte_size)
        at = layout.generation_offset(slot)
        if at + GEN.size > len(view):
            lease.release()
            lease = registry.acquire(ShmRef(region, GEN.size, at), client=client)
            at = 0
    except BaseException:
        lease.release()
        raise
    guard = SlotGuard(lease, at, region, slot, gen, what)
    try:
        guard.check("before the request was read", "the reference is stale")
        view = lease.mapped(start, byte_size) if read else None
    except InferenceError:
        guard.release()
        raise
    return ShmRef(region, byte_size, start), guard, view


# (datatype, shape) -> (numpy dtype, byte size) of fixed-size tensors read in place from a slot: a
# camera sends the same few on every request; any miss or mismatch takes from_buffer, for its error.
_IN_PLACE: dict[tuple[str, tuple[int, ...]], tuple[np.dtype[Any], int]] = {}
_IN_PLACE_MAX = 512


def _in_place(view: memoryview, datatype: str, shape: tuple[int, ...], what: str) -> npt.NDArray[Any]:
    """datatypes.from_buffer (a view, sizes checked) with its per-call look-ups memoised."""
    spec = _IN_PLACE.get((datatype, shape))
    if spec is not None and view.nbytes == spec[1]:
        array: npt.NDArray[Any] = np.ndarray(shape, spec[0], view)
        return array
    array = datatypes.from_buffer(view, datatype, shape, what)
    if spec is None and datatype != "BYTES":
        if len(_IN_PLACE) >= _IN_PLACE_MAX:
            _IN_PLACE.clear()
        _IN_PLACE[datatype, shape] = (array.dtype, array.nbytes)
    return array


_SEQUENCE_FIELDS: dict[str, Any] = {"sequence_id": (int, str), "sequence_start": bool, "sequence_end": bool}


def decode_infer(
    header: dict[str, Any],
    frames: Sequence[Any],
    registry: SharedMemoryRegistry,
    client: ShmClient | None = None,
) -> Decoded:
    """Build the request; on error every lease taken so far is released before raising.
    `client`: who names shm regions (None: in-process)."""
    where = "request header"
    model, version = header.get("model"), header.get("version", "")
    priority, timeout_us = header.get("priority", 0), header.get("timeout_us", 0)
    # The common case in one test; any other goes field by field, for the error that names it.
    if type(model) is not str or type(version) is not str or type(priority) is not int:
        model = _field(header, "model", str, where)
        version = str(_field(header, "version", (str, int), where, ""))
        priority = _field(header, "priority", int, where, 0)
    if type(timeout_us) is not int:
        timeout_us = _field(header, "timeout_us", int, where, 0)
    if not model:
        raise invalid_arg("request header: 'model' must name a model")
    req_id = header.get("id")
    request = InferRequest(
        model_name=model,
        model_version=version,
        id="" if req_id is None else str(req_id),
        parameters=_params(header, where) if "parameters" in header else {},
        priority=priority,
        timeout_us=timeout_us,
        shm_client=client,
    )
    if "sequence_id" in header or "sequence_start" in header or "sequence_end" in header:
        for key in _SEQUENCE_FIELDS:  # top-level shorthands for the sequence batcher's parameters
            if key in header:
                request.parameters[key] = _field(header, key, _SEQUENCE_FIELDS[key], where)
    if request.priority < 0 or request.timeout_us < 0:
        raise invalid_arg("request header: 'priority' and 'timeout_us' must not be negative")
    request.timeout_us = clamp_timeout_us(request.timeout_us)
    decoded = Decoded(req_id, request)
    try:
        _decode_tensors(header, frames, registry, decoded)
    except BaseException:
        decoded.release()
        raise
    return decoded


def _decode_tensors(
    header: dict[str, Any], frames: Sequence[Any], registry: SharedMemoryRegistry, decoded: Decoded
) -> None:
    request = decoded.request
    inputs = _field(header, "inputs", list, "request header")
    frame_index = 0
    for i, desc in enumerate(inputs):
        if not isinstance(desc, dict):
            raise invalid_arg(f"request header: inputs[{i}] must be an object")
        name = desc.get("name")
        if type(name) is not str:
            name = _field(desc, "name", str, f"inputs[{i}]")
        what = f"input '{name}'"
        datatype = desc.get("datatype")
        if type(datatype) is not str:
            datatype = _field(desc, "datatype", str, what)
        shape = _shape(desc, what)
        tensor = InputTensor(
            name, datatype, shape, parameters=_params(desc, what) if "parameters" in desc else {}
        )
        if "shm" in desc:
            ref, guard, view = _resolve_ref(registry, desc["shm"], what, request.shm_client, read=True)
            if guard is not None:
                decoded.guards.append(guard)
            if view is None:
                tensor.shm = ref  # the data plane leases and reads it
            else:
                tensor.data = _in_place(view, datatype, shape, what)
                decoded.in_slots.append(tensor)
        else:
            if frame_index >= len(frames):
                raise invalid_arg(
                    f"{what} has no shared memory reference and no tensor frame follows the header "
                    f"({len(frames)} tensor frame(s) for the inline inputs)"
                )
            frame = frames[frame_index]
            frame_index += 1
            buffer = frame.buffer if hasattr(frame, "buffer") else frame
            tensor.data = datatypes.from_buffer(buffer, datatype, shape, what)
        request.inputs.append(tensor)
    if frame_index != len(frames):
        raise invalid_arg(
            f"request has {len(frames)} tensor frame(s) but only {frame_index} inline input(s) in its header"
        )
    outputs = _field(header, "outputs", list, "request header", None)
    if outputs is None:
        return
    request.outputs = []
    for i, desc in enumerate(outputs):
        if not isinstance(desc, dict):
            raise invalid_arg(f"request header: outputs[{i}] must be an object")
        name = _field(desc, "name", str, f"outputs[{i}]")
        what = f"output '{name}'"
        wanted = RequestedOutput(
            name, classification=_field(desc, "classification", int, what, 0), parameters=_params(desc, what)
        )
        if "shm" in desc:
            ref, guard, _ = _resolve_ref(registry, desc["shm"], what, request.shm_client)
            if guard is None:
                wanted.shm = ref  # a plain region: the data plane writes it
            else:
                if wanted.classification:
                    guard.release()
                    raise invalid_arg(f"{what}: shared memory cannot be combined with classification")
                try:
                    lease = registry.acquire(ref, write=True, client=request.shm_client)
                except BaseException:
                    guard.release()
                    raise
                decoded.out_slots[name] = OutputSlot(name, guard, lease, desc["shm"])
        request.outputs.append(wanted)
