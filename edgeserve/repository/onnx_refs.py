"""The external-data file names an ONNX file points at, read from the protobuf wire format.

ONNX Runtime and OpenVINO open `TensorProto.external_data["location"]` relative to the model file.
Recent releases refuse locations outside the model's folder, older ones (still allowed by our
dependency ranges) do not, so the repository checks files sent with a load request itself. Walking
the wire format directly needs no `onnx` package (an optional dependency) and skips tensor payloads
without copying them.
"""

from __future__ import annotations

from collections.abc import Iterator

from edgeserve.protocol.varint import read_varint

# message kinds, and for each the fields (number -> kind) that can lead to a TensorProto
_MODEL, _GRAPH, _NODE, _ATTR, _TENSOR, _SPARSE, _FUNCTION, _TRAINING, _ENTRY = range(9)
_CHILDREN: dict[int, dict[int, int]] = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _FUNCTION: {7: _NODE},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTR},
    _ATTR: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
    _TENSOR: {13: _ENTRY},
    _ENTRY: {},
}
_MAX_DEPTH = 64  # subgraphs nest (If/Loop bodies); protobuf's own parser stops at 100


class NotOnnx(ValueError):
    """The bytes are not a protobuf message (so not an ONNX model)."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    try:
        return read_varint(data, pos, len(data))
    except ValueError as exc:
        raise NotOnnx(str(exc)) from None


def _fields(data: memoryview) -> Iterator[tuple[int, memoryview | None]]:
    """(field number, payload of a length-delimited field or None) for each field of one message."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
            yield number, None
        elif wire == 1:
            pos += 8
            yield number, None
        elif wire == 5:
            pos += 4
            yield number, None
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise NotOnnx("a field runs past the end")
            yield number, data[pos : pos + size]
            pos += size
        else:  # groups (3, 4) never appear in ONNX
            raise NotOnnx(f"unexpected wire type {wire}")
        if pos > len(data):
            raise NotOnnx("truncated field")


def _entry(data: memoryview) -> tuple[str, str]:
    key = value = ""
    for number, payload in _fields(data):
        if payload is not None and number in (1, 2):
            text = bytes(payload).decode("utf-8", errors="replace")
            key, value = (text, value) if number == 1 else (key, text)
    return key, value


def external_locations(data: bytes | memoryview) -> list[str]:
    """Every `location` of external data in an ONNX model (initializers, constants, subgraphs,
    functions); raises NotOnnx when the bytes are not a protobuf message."""
    found: list[str] = []
    stack: list[tuple[int, memoryview, int]] = [(_MODEL, memoryview(data), 0)]
    while stack:
        kind, message, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise NotOnnx("nested deeper than any real model")
        children = _CHILDREN[kind]
        for number, payload in _fields(message):
            child = children.get(number)
            if child is None or payload is None:
                continue
            if child == _ENTRY:
                key, value = _entry(payload)
                if key == "location":
                    found.append(value)
            else:
                stack.append((child, payload, depth + 1))
    return found
