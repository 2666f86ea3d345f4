"""Protobuf base-128 varints, read and written without the protobuf runtime (the gRPC frontend's
request scan and the repository's ONNX external-data walk both read the wire format directly)."""

from __future__ import annotations


def encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError("varint of a negative value")
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`; ValueError when it runs past `end` or
    is longer than the 10 bytes a 64-bit value takes."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")
