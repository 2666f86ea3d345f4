from __future__ import annotations

import struct

import numpy as np
import pytest

from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status


@pytest.mark.parametrize(
    "datatype",
    list(datatypes.FIXED_SIZE_DATATYPES),
)
def test_fixed_size_roundtrip_is_a_view(datatype: str) -> None:
    dtype = datatypes.numpy_dtype(datatype)
    array = (
        (np.arange(12) % 2).astype(dtype).reshape(3, 4)
        if datatype == "BOOL"
        else np.arange(12).astype(dtype).reshape(3, 4)
    )
    wire = datatypes.to_wire_bytes(array, datatype)
    buffer = bytearray(wire)
    view = datatypes.from_buffer(buffer, datatype, (3, 4), "input 'x'")
    np.testing.assert_array_equal(view.astype(np.float64), array.astype(np.float64))
    buffer[0 : datatypes.element_size(datatype)] = bytes(datatypes.element_size(datatype))
    assert view.reshape(-1)[0] == 0  # shares memory with the buffer: no copy on the way in
    assert datatypes.from_numpy(dtype) == datatype


def test_size_mismatch_names_tensor_and_sizes() -> None:
    with pytest.raises(InferenceError) as info:
        datatypes.from_buffer(b"\0" * 10, "FP32", (2, 2), "input 'INPUT0'")
    assert info.value.status is Status.INVALID_ARG
    assert (
        "input 'INPUT0'" in info.value.message
        and "10 bytes" in info.value.message
        and "16" in info.value.message
    )


def test_bytes_codec_roundtrip_and_layout() -> None:
    array = np.array([b"a", b"", "\u00e9t\u00e9".encode()], dtype=np.object_)
    wire = datatypes.serialize_bytes(array)
    assert wire[:5] == struct.pack("<I", 1) + b"a"
    back = datatypes.deserialize_bytes(wire, 3)
    assert list(back) == list(array)


@pytest.mark.parametrize(
    ("wire", "count", "fragment"),
    [
        (struct.pack("<I", 5) + b"ab", 1, "past the end"),
        (struct.pack("<I", 1) + b"a" + b"zz", 1, "trailing"),
        (struct.pack("<I", 1) + b"a" + b"xyz", 2, "ends before element 1"),
        (struct.pack("<I", 1) + b"a", 1000, "declares 1000 BYTES elements"),
    ],
)
def test_bytes_codec_rejects_malformed(wire: bytes, count: int, fragment: str) -> None:
    with pytest.raises(InferenceError) as info:
        datatypes.deserialize_bytes(wire, count)
    assert fragment in info.value.message


def test_unknown_datatype_and_negative_shape() -> None:
    with pytest.raises(InferenceError, match="unknown datatype 'FP8'"):
        datatypes.numpy_dtype("FP8")
    with pytest.raises(InferenceError, match="negative"):
        datatypes.element_count((2, -1))


def test_config_names_map_both_ways() -> None:
    assert datatypes.config_to_protocol("TYPE_STRING") == "BYTES"
    assert datatypes.protocol_to_config("BF16") == "TYPE_BF16"
    with pytest.raises(InferenceError):
        datatypes.config_to_protocol("TYPE_NOPE")
