"""Server side of the wire format, the replies: `InferResponse` -> reply frames (and errors).

Ring-slot outputs are written here, guarded by their slot's generation (codec.SlotGuard); the header
of a plain reply is built once per model, version and outputs and reused with the request's id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.frontends.zmq import wire
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, invalid_arg
from edgeserve.protocol.inference import InferResponse

if TYPE_CHECKING:
    from edgeserve.frontends.zmq.codec import Decoded, OutputSlot


def error_reply(req_id: Any, exc: InferenceError, final: bool | None = None) -> list[Any]:
    """`final`: set on a streamed request's replies (None: a unary reply, which has no such field)."""
    body = {"v": wire.VERSION, "id": req_id, "status": exc.status.value, "message": exc.message}
    if final is not None:
        body["final"] = final
    return [wire.dumps(body)]


def ok_reply(req_id: Any, body: dict[str, Any]) -> list[Any]:
    return [wire.dumps({"v": wire.VERSION, "id": req_id, "status": wire.STATUS_OK, **body})]


# The header of a plain reply (integer id, every output inline, no parameters) after its id, by model,
# version and outputs: a model answers with the same few, and building one is most of a reply's cost.
_TAILS: dict[tuple[Any, ...], bytes] = {}
_TAILS_MAX = 512
_PLAIN_ID = range(-(2**63), 2**64)  # ids any JSON encoder writes as digits
_PLAIN_DATATYPES = frozenset(("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                              "INT64", "FP16", "FP32", "FP64"))  # fmt: skip


def _plain_reply(req_id: Any, response: InferResponse) -> list[Any] | None:
    """The frames of a plain reply, or None for any other (then built field by field)."""
    if type(req_id) is not int or req_id not in _PLAIN_ID or response.parameters:
        return None
    key: list[Any] = [response.model_name, response.model_version]
    frames: list[Any] = [b""]
    for out in response.outputs:
        data = out.data
        if out.parameters or out.shm is not None or data is None:
            return None
        key.append((out.name, out.datatype, out.shape))
        if type(data) is np.ndarray and data.flags.c_contiguous and out.datatype in _PLAIN_DATATYPES:
            frames.append(data)  # its buffer, as to_wire_bytes would give it
        else:
            frames.append(datatypes.to_wire_bytes(data, out.datatype))
    try:
        tail = _TAILS.get(tuple(key))
    except TypeError:  # a shape given as a list
        return None
    if tail is None:
        outputs = [{"name": n, "datatype": d, "shape": [int(x) for x in s]} for n, d, s in key[2:]]
        body = {"status": wire.STATUS_OK, "model": key[0], "version": key[1], "outputs": outputs}
        if len(_TAILS) >= _TAILS_MAX:
            _TAILS.clear()
        tail = _TAILS[tuple(key)] = b"," + wire.dumps(body)[1:]
    frames[0] = b'{"v":%d,"id":%d%s' % (wire.VERSION, req_id, tail)
    return frames


def infer_reply(decoded: Decoded, response: InferResponse) -> list[Any]:
    """Reply frames for a finished request; ring outputs are written here, guarded. Runs on a worker."""
    for guard in decoded.guards:
        guard.check("while the request was in flight", "the result was discarded")
    if not decoded.out_slots:
        plain = _plain_reply(decoded.req_id, response)
        if plain is not None:
            return plain
    outputs: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    for out in response.outputs:
        desc: dict[str, Any] = {
            "name": out.name,
            "datatype": out.datatype,
            "shape": [int(d) for d in out.shape],
        }
        if out.parameters:
            desc["parameters"] = out.parameters
        slot = decoded.out_slots.get(out.name)
        if out.shm is not None:
            desc["shm"] = wire.shm_ref(out.shm.region, out.shm.byte_size, out.shm.offset)
        elif slot is not None:
            assert out.data is not None
            desc["shm"] = {**slot.ref, "byte_size": _write_slot(slot, out.data, out.datatype)}
        else:
            assert out.data is not None
            frames.append(datatypes.to_wire_bytes(out.data, out.datatype))
        outputs.append(desc)
    frames[0] = infer_header(decoded.req_id, response, outputs)
    return frames


def stream_reply(
    decoded: Decoded, result: InferResponse | InferenceError | None, final: bool, model: str, version: str
) -> list[Any]:
    """One reply of a streamed request (wire field "final"); `result` None is the final flag alone,
    sent as a reply without outputs. Outputs are inline (a stream refuses shm outputs). On the router
    thread."""
    req_id = decoded.req_id
    if isinstance(result, InferenceError):
        return error_reply(req_id, result, final)
    try:
        for guard in decoded.guards:
            guard.check("while the request was in flight", "the response was discarded")
        if result is None:
            return ok_reply(req_id, {"model": model, "version": version, "outputs": [], "final": final})
        outputs: list[dict[str, Any]] = []
        frames: list[Any] = [b""]
        for out in result.outputs:
            desc: dict[str, Any] = {"name": out.name, "datatype": out.datatype,
                                    "shape": [int(d) for d in out.shape]}  # fmt: skip
            if out.parameters:
                desc["parameters"] = out.parameters
            assert out.data is not None
            frames.append(datatypes.to_wire_bytes(out.data, out.datatype))
            outputs.append(desc)
        frames[0] = infer_header(req_id, result, outputs, final)
        return frames
    except InferenceError as exc:
        return error_reply(req_id, exc, final)


def infer_header(
    req_id: Any, response: InferResponse, outputs: list[dict[str, Any]], final: bool | None = None
) -> Any:
    """The header frame of an infer reply built field by field, `outputs` its outputs' descriptions;
    `final` is set on a streamed request's replies only."""
    body: dict[str, Any] = {
        "model": response.model_name,
        "version": response.model_version,
        "outputs": outputs,
    }
    if response.parameters:
        body["parameters"] = response.parameters
    if final is not None:
        body["final"] = final
    return ok_reply(req_id, body)[0]


def _write_slot(slot: OutputSlot, array: Any, datatype: str) -> int:
    payload = datatypes.to_wire_bytes(array, datatype)
    size = memoryview(payload).nbytes
    if size > slot.byte_size:
        raise invalid_arg(
            f"shared memory size specified with the request for output '{slot.name}' ({slot.byte_size} "
            f"bytes) should be at least {size} bytes to hold the results"
        )
    slot.guard.check("before the output was written", "the output was not written")
    slot.lease.view[:size] = payload
    slot.guard.check("while the output was being written", "the slot's contents are undefined")
    return size
