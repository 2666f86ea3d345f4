"""JSON tensor `data` <-> numpy: nested or flat row-major lists, strictly typed per datatype."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import invalid_arg

MAX_JSON_DEPTH = 100  # Triton's nesting limit for tensor `data`


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flatten(data: list[Any], out: list[Any], depth: int, what: str) -> None:
    if depth > MAX_JSON_DEPTH:
        raise invalid_arg(f"{what}: 'data' is nested deeper than {MAX_JSON_DEPTH} levels")
    for item in data:
        if isinstance(item, list):
            _flatten(item, out, depth + 1, what)
        else:
            out.append(item)


def json_to_array(data: Any, datatype: str, shape: tuple[int, ...], what: str) -> npt.NDArray[Any]:
    """Nested or flat row-major JSON `data` -> an array of `datatype` and `shape`, strictly typed."""
    if not isinstance(data, list):
        raise invalid_arg(f"{what}: 'data' must be a JSON array, got {type(data).__name__}")
    count = datatypes.element_count(shape)
    flat: list[Any] = []
    _flatten(data, flat, 1, what)
    if len(flat) != count:
        raise invalid_arg(
            f"{what}: unexpected number of elements: 'data' has {len(flat)}, "
            f"shape {list(shape)} needs {count}"
        )
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        for i, item in enumerate(flat):
            if not isinstance(item, str):
                raise invalid_arg(f"{what}: BYTES element {i} must be a JSON string, got {json.dumps(item)}")
            try:
                out[i] = item.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\ud800"): valid JSON, not text
                raise invalid_arg(
                    f"{what}: BYTES element {i} is not valid Unicode text (it holds a lone surrogate)"
                ) from None
        return out.reshape(shape)
    dtype = datatypes.numpy_dtype(datatype)
    if count == 0:
        return np.empty(shape, dtype=dtype)
    try:
        raw = np.asarray(flat)
    except (ValueError, TypeError):
        raw = np.asarray(flat, dtype=np.object_)
    if raw.dtype.kind in "fO" and dtype.kind in "iu" and all(is_int(x) for x in flat):
        try:  # integers past int64 (UINT64 values, or out of range for every type)
            raw = np.array(flat, dtype=dtype)
        except OverflowError:
            raise invalid_arg(f"{what}: a value is out of range for {datatype}") from None
    kind = raw.dtype.kind
    if datatype == "BOOL":
        ok = kind == "b"
        expected = "true/false"
    elif dtype.kind in "iu":
        ok = kind in "iu"
        expected = "integers"
        if ok:
            info = np.iinfo(dtype)
            if raw.min() < info.min or raw.max() > info.max:
                raise invalid_arg(f"{what}: a value is out of range for {datatype} ({info.min}..{info.max})")
    else:  # FP16 / FP32 / FP64 / BF16
        ok = kind in "iuf"
        expected = "numbers"
    if not ok:
        bad = next((x for x in flat if not _json_matches(x, datatype)), flat[0])
        raise invalid_arg(f"{what}: {datatype} data must be {expected}; got {json.dumps(bad)[:80]}")
    if datatype == "BF16":
        return raw.astype(np.float32).astype(dtype).reshape(shape)
    return raw.astype(dtype, copy=False).reshape(shape)


def _json_matches(item: Any, datatype: str) -> bool:
    if datatype == "BOOL":
        return isinstance(item, bool)
    if datatype.startswith(("INT", "UINT")):
        return is_int(item)
    return isinstance(item, (int, float)) and not isinstance(item, bool)


def array_to_json(array: npt.NDArray[Any], datatype: str) -> list[Any]:
    flat = np.asarray(array).reshape(-1)
    if datatype == "BYTES":
        return [
            x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x) for x in flat
        ]
    if datatype == "BF16":
        flat = flat.astype(np.float32)
    values: list[Any] = flat.tolist()
    return values
