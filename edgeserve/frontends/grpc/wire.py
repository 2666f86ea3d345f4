"""Protobuf wire helpers that keep tensor bytes out of the protobuf runtime.

Requests: `raw_input_contents` (field 7 of ModelInferRequest) are found by a top-level scan of the
received bytes and handed on as memoryviews into them; only the small remainder (names, shapes,
parameters) goes through `ModelInferRequest.FromString`. Parsing the whole message would copy every
tensor twice (into the upb arena, then into a new `bytes` on access): ~2 x 24 MB for a 4K frame.

Responses: the protobuf part is serialised without tensors and the `raw_output_contents` entries
(field 6) are appended as framed byte runs, so each output is copied exactly once (by the join).
A message is a sequence of fields; appending repeated fields after the rest is valid protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from edgeserve.protocol.varint import encode_varint, read_varint

Buffer = bytes | bytearray | memoryview

RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
RAW_OUTPUT_TAG = bytes([(6 << 3) | 2])  # ModelInferResponse.raw_output_contents, length-delimited
STREAM_INFER_RESPONSE_TAG = bytes([(2 << 3) | 2])  # ModelStreamInferResponse.infer_response
# Below this size the stock parser is faster than a Python-level scan, and the copies are trivial.
SCAN_THRESHOLD = 64 * 1024


@dataclass(slots=True)
class Malformed:
    """A request that did not parse; the handler answers it (INTERNAL, as grpc's own parser does)."""

    reason: str

    @property
    def message(self) -> str:
        return f"Unable to parse request: {self.reason}"


@dataclass(slots=True)
class DecodedInfer:
    """A ModelInferRequest whose `raw_input_contents` live in `raw` (views into the received bytes)."""

    message: service_pb2.ModelInferRequest
    raw: list[Buffer]
    nbytes: int


def split_raw_inputs(data: Buffer) -> tuple[Buffer, list[memoryview]]:
    """(the message without field 7, the field-7 payloads as views into `data`)."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    end = view.nbytes
    pos = 0
    raw: list[memoryview] = []
    spans: list[list[int]] = []  # [start, stop) runs of everything that is not field 7
    while pos < end:
        start = pos
        key, pos = read_varint(view, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == 0:
            _, pos = read_varint(view, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            length, pos = read_varint(view, pos, end)
            if pos + length > end:
                raise ValueError(f"field {field} declares {length} bytes past the end of the message")
            if field == RAW_INPUT_FIELD:
                raw.append(view[pos : pos + length])
                pos += length
                continue
            pos += length
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} (field {field})")
        if pos > end:
            raise ValueError("truncated message")
        if spans and spans[-1][1] == start:
            spans[-1][1] = pos
        else:
            spans.append([start, pos])
    if not spans:
        rest: Buffer = b""
    elif len(spans) == 1:
        rest = view[spans[0][0] : spans[0][1]]
    else:
        rest = b"".join(view[a:b] for a, b in spans)
    return rest, raw


def deserialize_infer_request(data: bytes) -> DecodedInfer | Malformed:
    """Request deserializer for ModelInfer / ModelStreamInfer; never raises."""
    try:
        if len(data) < SCAN_THRESHOLD:
            message = service_pb2.ModelInferRequest.FromString(data)
            return DecodedInfer(message, list(message.raw_input_contents), len(data))
        rest, views = split_raw_inputs(data)
        message = service_pb2.ModelInferRequest.FromString(rest)
        return DecodedInfer(message, list(views), len(data))
    except (DecodeError, ValueError, TypeError) as exc:
        return Malformed(str(exc) or type(exc).__name__)


def safe_deserializer(message_type: Any) -> Any:
    """`message_type.FromString` that returns `Malformed` instead of raising (no traceback spam)."""

    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return Malformed(str(exc) or type(exc).__name__)

    return deserialize


def identity(data: bytes) -> bytes:
    """Response serializer for handlers that return wire bytes already."""
    return data


def framed_raw_outputs(buffers: Sequence[Buffer]) -> tuple[list[Buffer], int]:
    """Field-6 frames for `buffers` and their total wire size."""
    parts: list[Buffer] = []
    total = 0
    for buffer in buffers:
        size = memoryview(buffer).nbytes
        header = RAW_OUTPUT_TAG + encode_varint(size)
        parts.append(header)
        if size:
            parts.append(buffer)
        total += len(header) + size
    return parts, total


def infer_response_bytes(base: bytes, buffers: Sequence[Buffer]) -> tuple[list[Buffer], int]:
    """The ModelInferResponse wire parts: `base` (the message without raw outputs) + raw outputs."""
    parts, size = framed_raw_outputs(buffers)
    return [base, *parts], len(base) + size


def wrap_stream_response(parts: list[Buffer], size: int) -> list[Buffer]:
    """ModelStreamInferResponse{infer_response = <parts>} without re-copying the inner message."""
    return [STREAM_INFER_RESPONSE_TAG + encode_varint(size), *parts]


def join(parts: list[Buffer]) -> bytes:
    if len(parts) == 1 and isinstance(parts[0], bytes):
        return parts[0]
    return b"".join(parts)
