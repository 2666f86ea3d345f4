"""The edgeserve ZeroMQ wire format, version 1: shared by the server frontend and the Python client.

A message is one header frame (a UTF-8 JSON object whose first field is `"v"`, the wire version)
followed by zero or more raw tensor frames. README.md in this folder is the specification.
JSON costs <1 us per header each way with orjson (a dependency; the stdlib's ~3 us is the fallback
where it is missing): a struct-packed header would buy little and cost the extensibility of named
fields.
"""

from __future__ import annotations

import json
from typing import Any

import zmq

VERSION = 1

# Operations a client may send; the server replies to each with the same "id".
OP_INFER = "infer"
OP_PING = "ping"
OP_REGISTER = "register"
OP_UNREGISTER = "unregister"
OP_STATUS = "status"
OP_METADATA = "metadata"
OP_READY = "ready"
OP_BYE = "bye"
# Ends a streamed request (`"stream": true`) early: its "id" is that request's; no reply of its own.
OP_CANCEL = "cancel"
# Sent by the server on its own (no id) to check a client is still there; clients ignore it.
OP_PROBE = "probe"

STATUS_OK = "OK"

# Frames smaller than this are copied into the message when sent, by the server and the client:
# cheaper than pinning their buffer until ZeroMQ has sent it (pyzmq's own copy threshold).
ZERO_COPY_MIN = 65536


def send_copy(frame: Any) -> bool:
    """Whether to send `frame` (bytes, memoryview, ndarray) from a copy."""
    if type(frame) is bytes:  # headers and small payloads: no attribute lookup that fails
        return len(frame) < ZERO_COPY_MIN
    size = getattr(frame, "nbytes", None)
    return (len(frame) if size is None else size) < ZERO_COPY_MIN


# pyzmq's Cython socket methods, called past the `zmq.Socket` sugar layer. Its `send` hands its
# arguments on through super() as keywords: ≈3.5 µs per frame here against 0.4 µs for the Cython
# call itself, on every frame of every request and reply. Called as `sock_send(sock, data, flags,
# copy)`, `sock_recv(sock, flags, copy)`, `sock_get(sock, option)`.
_Backend: Any = getattr(zmq, "backend", None)
_BackendSocket: Any = getattr(_Backend, "Socket", None)
if not (isinstance(_BackendSocket, type) and issubclass(zmq.Socket, _BackendSocket)):  # pragma: no cover
    _BackendSocket = zmq.Socket  # another pyzmq layout: the public methods
sock_send: Any = _BackendSocket.send
sock_recv: Any = _BackendSocket.recv
sock_get: Any = _BackendSocket.get


try:  # the bytes on the wire are the same compact JSON either way
    import orjson as _orjson

    _ascii_fallback = json.JSONEncoder(separators=(",", ":"))

    def dumps(obj: dict[str, Any]) -> bytes:
        try:
            data: bytes = _orjson.dumps(obj)
        except TypeError:  # a lone surrogate from a client's JSON (echoed in an error): escape it
            return _ascii_fallback.encode(obj).encode("ascii")
        return data

    def loads(data: Any) -> Any:
        return _orjson.loads(data)

except ImportError:  # pragma: no cover - depends on the environment
    _encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
    _decoder = json.JSONDecoder()

    _ascii_encoder = json.JSONEncoder(separators=(",", ":"))

    def dumps(obj: dict[str, Any]) -> bytes:
        try:
            return _encoder.encode(obj).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a client's JSON (echoed in an error): escape it
            return _ascii_encoder.encode(obj).encode("ascii")

    def loads(data: Any) -> Any:
        """The header object; ValueError for anything that is not JSON (nested too deeply too)."""
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)
        try:
            return json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None


def shm_ref(
    region: str, byte_size: int, offset: int = 0, slot: int | None = None, gen: int | None = None
) -> dict[str, Any]:
    """The JSON form of a shared-memory reference; `slot`/`gen` make it a ring-slot reference."""
    ref: dict[str, Any] = {"region": region, "byte_size": int(byte_size)}
    if offset:
        ref["offset"] = int(offset)
    if slot is not None:
        ref["slot"] = int(slot)
        ref["gen"] = int(gen if gen is not None else 0)
    return ref
