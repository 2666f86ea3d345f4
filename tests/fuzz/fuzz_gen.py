"""Generators of malformed and adversarial requests, one family per frontend (fuzz_gen_http.py,
fuzz_gen_grpc.py, fuzz_gen_zmq.py); this module holds what they share: the fuzz models, weird values
and shapes, valid inputs to start from, byte mutations.

Every generator takes a `random.Random` and returns one case; the same seed gives the same cases.
Cases start from a correct request for one of the fuzz models and break it in one or a few ways
(wrong types, lying sizes, huge/negative/too many dims, deep nesting, truncation, bad UTF-8,
bad references), or are plain random bytes.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import numpy as np

# -- the fuzz models (see fuzz_engine.build_repository) ---------------------------------------------
# name -> (inputs [(name, datatype, dims without batch)], outputs, max_batch)
MODELS: dict[str, tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]], int]] = {
    "add_sub": (
        [("INPUT0", "FP32", [16]), ("INPUT1", "FP32", [16])],
        [("OUTPUT0", "FP32", [16]), ("OUTPUT1", "FP32", [16])],
        8,
    ),
    "id_bytes": ([("INPUT0", "BYTES", [-1])], [("OUTPUT0", "BYTES", [-1])], 8),
    "id_fp16": ([("INPUT0", "FP16", [-1])], [("OUTPUT0", "FP16", [-1])], 8),
    "id_int64": ([("INPUT0", "INT64", [-1])], [("OUTPUT0", "INT64", [-1])], 8),
    "id_bool": ([("INPUT0", "BOOL", [-1])], [("OUTPUT0", "BOOL", [-1])], 8),
    "conv": ([("images", "FP32", [3, -1, -1])], [("features", "FP32", [4, -1, -1])], 4),
    "id_nobatch": ([("INPUT0", "UINT8", [-1, -1])], [("OUTPUT0", "UINT8", [-1, -1])], 0),
}

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]
NP = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}

HUGE_INTS = [2**31, 2**32, 2**40, 2**40 + 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
NEG_INTS = [-1, -2, -(2**31), -(2**63), -(2**63) - 1, -(10**30)]
PB_STRINGS = ["", " ", "\x00", "ä", "💥", "a" * 5000, "../x", "%s%n", "INPUT0\x00", "fp32", "1"]
WEIRD_STRINGS = [
    "",
    " ",
    "\x00",
    "ä",
    "💥",
    "a" * 5000,
    "../../etc/passwd",
    "%s%n",
    "\ud800x",
    "INPUT0\x00",
    "FP32 ",
    "fp32",
    "TYPE_FP32",
    "STRING",
    "null",
    "1",
]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80"]


def weird_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of a random, often wrong, type."""
    choice = rng.randrange(14 if depth < 3 else 10)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice(HUGE_INTS + NEG_INTS + [0, 1, 7])
    if choice == 3:
        return rng.choice([0.5, -0.0, 1e308, -1e308, 3.0, 1e-320])
    if choice == 4:
        return rng.choice(WEIRD_STRINGS)
    if choice == 5:
        return rng.randrange(-5, 100)
    if choice == 6:
        return "x" * rng.randrange(0, 50)
    if choice == 7:
        return []
    if choice == 8:
        return {}
    if choice == 9:
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if choice in (10, 11):
        return [weird_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {
        rng.choice([*WEIRD_STRINGS, "name", "shape", "data"]): weird_value(rng, depth + 1)
        for _ in range(rng.randrange(0, 4))
    }


def weird_shape(rng: random.Random) -> Any:
    kind = rng.randrange(12)
    if kind == 0:
        return [rng.choice(NEG_INTS)]
    if kind == 1:
        return [1, rng.choice(HUGE_INTS)]
    if kind == 2:
        return [1] * rng.choice([33, 64, 65, 66, 100, 1000])
    if kind == 3:
        return [0] * rng.choice([64, 65, 200])
    if kind == 4:
        return [rng.choice(HUGE_INTS), 0]
    if kind == 5:
        return [1, rng.choice([1.0, 1.5, "4", None, True, [], {}, float("nan")])]
    if kind == 6:
        return rng.choice([None, "16", 16, {}, True, 1.0])
    if kind == 7:
        return []
    if kind == 8:
        return [2**32 + 1, 2**32 + 1]
    if kind == 9:
        return [rng.choice(HUGE_INTS)] * rng.randrange(2, 5)
    if kind == 10:
        return [1, 0, rng.choice(HUGE_INTS)]
    return [rng.randrange(0, 5) for _ in range(rng.randrange(0, 5))]


def valid_shape(rng: random.Random, model: str) -> list[int]:
    inputs, _, max_batch = MODELS[model]
    dims = inputs[0][2]
    shape = [rng.randrange(1, max_batch + 1)] if max_batch else []
    for d in dims:
        shape.append(rng.randrange(1, 5) if d == -1 else d)
    return shape


def sample_array(rng: random.Random, datatype: str, shape: list[int]) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        items = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 6))) for _ in range(count)]
        arr = np.empty(count, dtype=np.object_)
        arr[:] = items
        return arr.reshape(shape)
    if datatype == "BOOL":
        return np.array([rng.random() < 0.5 for _ in range(count)], dtype=np.bool_).reshape(shape)
    if datatype in ("FP16", "FP32", "FP64"):
        return np.array([rng.uniform(-4, 4) for _ in range(count)], dtype=NP[datatype]).reshape(shape)
    return np.array([rng.randrange(0, 100) for _ in range(count)], dtype=NP[datatype]).reshape(shape)


def wire_bytes(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(x)) + x for x in array.reshape(-1))
    return np.ascontiguousarray(array).tobytes()


def json_data(array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [x.decode("latin-1") for x in flat]
    return flat.tolist()  # type: ignore[no-any-return]


def valid_inputs(rng: random.Random, model: str) -> list[tuple[str, str, list[int], np.ndarray]]:
    inputs, _, _ = MODELS[model]
    shape = valid_shape(rng, model)
    out = []
    for name, datatype, _ in inputs:
        out.append((name, datatype, shape, sample_array(rng, datatype, shape)))
    return out


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Bit flips, truncation, insertion, duplication, or splices of garbage."""
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        if op == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif op == 2:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        elif op == 3 and buf:
            i = rng.randrange(len(buf))
            buf[i] = rng.choice([0x00, 0xFF, 0x7F, 0x80])
        elif op == 4 and buf:
            i, j = sorted(rng.randrange(len(buf) + 1) for _ in range(2))
            buf[j:j] = buf[i:j]
        elif buf:
            i = rng.randrange(len(buf))
            buf[i : i + 1] = rng.choice(BAD_UTF8)
    return bytes(buf)


def random_bytes(rng: random.Random, limit: int = 512) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, limit)))
