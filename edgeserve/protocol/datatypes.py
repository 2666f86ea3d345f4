"""Datatypes of the KServe V2 / Triton protocol, their numpy dtypes and the BYTES codec."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.protocol.errors import invalid_arg

try:  # tritonclient depends on ml_dtypes, so it is normally present
    from ml_dtypes import bfloat16 as _bfloat16

    BF16_DTYPE: np.dtype[Any] | None = np.dtype(_bfloat16)
except ImportError:  # pragma: no cover - exercised only on minimal installs
    BF16_DTYPE = None

_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
if BF16_DTYPE is not None:
    _NUMPY["BF16"] = BF16_DTYPE

DATATYPES: tuple[str, ...] = (*_NUMPY, "BF16") if "BF16" not in _NUMPY else tuple(_NUMPY)

# model_config.proto DataType enum names <-> protocol strings
_CONFIG_TO_PROTOCOL: dict[str, str] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}
_PROTOCOL_TO_CONFIG = {v: k for k, v in _CONFIG_TO_PROTOCOL.items()}

_ELEMENT_SIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    "BF16": 2,
}
FIXED_SIZE_DATATYPES: tuple[str, ...] = tuple(_ELEMENT_SIZE)


def is_known(datatype: str) -> bool:
    return datatype in _CONFIG_TO_PROTOCOL.values()


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype that carries `datatype`; BYTES is an object array of `bytes`."""
    try:
        return _NUMPY[datatype]
    except KeyError:
        raise invalid_arg(f"unknown datatype '{datatype}'; expected one of {', '.join(DATATYPES)}") from None


def from_numpy(dtype: np.dtype[Any]) -> str:
    """Protocol datatype of a numpy dtype (object / bytes_ / str_ arrays are BYTES)."""
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    if BF16_DTYPE is not None and dtype == BF16_DTYPE:
        return "BF16"
    for name, candidate in _NUMPY.items():
        if candidate == dtype and name != "BYTES":
            return name
    raise invalid_arg(f"numpy dtype {dtype} has no protocol datatype")


def config_to_protocol(config_type: str) -> str:
    """'TYPE_FP32' -> 'FP32'; 'TYPE_STRING' -> 'BYTES'."""
    try:
        return _CONFIG_TO_PROTOCOL[config_type]
    except KeyError:
        raise invalid_arg(f"unsupported model config data type '{config_type}'") from None


def protocol_to_config(datatype: str) -> str:
    try:
        return _PROTOCOL_TO_CONFIG[datatype]
    except KeyError:
        raise invalid_arg(f"unknown datatype '{datatype}'") from None


def element_size(datatype: str) -> int:
    """Bytes per element for fixed-size types; raises for BYTES."""
    try:
        return _ELEMENT_SIZE[datatype]
    except KeyError:
        raise invalid_arg(f"datatype '{datatype}' has no fixed element size") from None


# numpy's limit on dimensions (NPY_MAXDIMS); also Triton's practical one.
MAX_DIMS = 64
# The most elements a shape may declare, zero dimensions left out: 1 TiB of UINT8, far beyond any
# real tensor and far enough below numpy's own limit (the byte size must fit a signed 64-bit int)
# that no shape that passes here makes numpy raise.
MAX_ELEMENTS = 2**40


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    """Elements of `shape`; INVALID_ARG for a negative dimension, more than MAX_DIMS dimensions, or
    more than MAX_ELEMENTS elements (counting only the non-zero dimensions: numpy refuses those
    shapes even when a zero dimension makes them empty)."""
    if len(shape) > MAX_DIMS:
        raise invalid_arg(f"shape has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    count = 1
    nonzero = 1
    for dim in shape:
        if dim < 0:
            raise invalid_arg(f"shape {list(shape)} has a negative dimension")
        count *= dim
        if dim:
            nonzero *= dim
    if nonzero > MAX_ELEMENTS:
        raise invalid_arg(f"shape {list(shape)} declares more than 2^40 elements, the most a tensor may have")
    return count


def from_buffer(buffer: Any, datatype: str, shape: tuple[int, ...], what: str) -> npt.NDArray[Any]:
    """A numpy **view** over `buffer` (bytes, memoryview, mmap slice, zmq frame) with an exact size check.

    `what` names the tensor in the error message, e.g. "input 'INPUT0'".
    """
    count = element_count(shape)
    if datatype == "BYTES":
        return deserialize_bytes(buffer, count, what).reshape(shape)
    dtype = numpy_dtype(datatype)
    expected = count * dtype.itemsize
    view = memoryview(buffer)
    if view.nbytes != expected:
        raise invalid_arg(
            f"{what}: got {view.nbytes} bytes for shape {list(shape)} of {datatype}, expected {expected}"
        )
    return np.frombuffer(view, dtype=dtype, count=count).reshape(shape)


def serialize_bytes(array: npt.NDArray[Any]) -> bytes:
    """BYTES wire layout: per element a little-endian uint32 length, then the bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        if isinstance(item, bytes):
            data = item
        elif isinstance(item, str):
            data = item.encode("utf-8")
        elif isinstance(item, (bytearray, memoryview)):
            data = bytes(item)
        else:
            data = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(buffer: Any, count: int, what: str = "tensor") -> npt.NDArray[Any]:
    """Parse `count` length-prefixed elements; the buffer must hold exactly that."""
    view = memoryview(buffer).cast("B")
    if count > view.nbytes // 4:  # each element needs its 4-byte length: refuse before allocating
        raise invalid_arg(
            f"{what}: shape declares {count} BYTES elements but the data holds at most {view.nbytes // 4}"
        )
    out = np.empty(count, dtype=np.object_)
    pos = 0
    end = view.nbytes
    for i in range(count):
        if pos + 4 > end:
            raise invalid_arg(f"{what}: BYTES data ends before element {i} of {count}")
        (length,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + length > end:
            raise invalid_arg(f"{what}: BYTES element {i} declares {length} bytes past the end of the data")
        out[i] = bytes(view[pos : pos + length])
        pos += length
    if pos != end:
        raise invalid_arg(f"{what}: {end - pos} unexpected trailing bytes after {count} BYTES elements")
    return out


def tensor_nbytes(array: npt.NDArray[Any], datatype: str) -> int:
    """Wire size of a tensor (serialised size for BYTES)."""
    if datatype == "BYTES":
        return sum(4 + len(x if isinstance(x, bytes) else str(x).encode()) for x in array.reshape(-1))
    return int(array.nbytes)


def to_wire_bytes(array: npt.NDArray[Any], datatype: str) -> bytes | memoryview:
    """Raw wire bytes of an output tensor; a zero-copy memoryview when the array is contiguous."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    # Viewing as uint8 first also covers dtypes the buffer protocol cannot export (bfloat16).
    flat: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(flat)
