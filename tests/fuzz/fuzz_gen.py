"""Generators of malformed and adversarial requests, one family per frontend.

Every generator takes a `random.Random` and returns one case; the same seed gives the same cases.
Cases start from a correct request for one of the fuzz models and break it in one or a few ways
(wrong types, lying sizes, huge/negative/too many dims, deep nesting, truncation, bad UTF-8,
bad references), or are plain random bytes.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import random
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

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


# == HTTP ============================================================================================
@dataclass
class HttpCase:
    kind: str
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None  # send these bytes over a raw TCP socket instead
    allow_501: bool = False  # an endpoint documented as unsupported (UNSUPPORTED -> 501)


def _infer_path(rng: random.Random, model: str) -> str:
    if rng.random() < 0.1:
        return f"/v2/models/{model}/versions/1/infer"
    return f"/v2/models/{model}/infer"


def http_json_valid(rng: random.Random, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": []}
    for name, datatype, shape, array in valid_inputs(rng, model):
        body["inputs"].append(
            {"name": name, "datatype": datatype, "shape": shape, "data": json_data(array, datatype)}
        )
    if rng.random() < 0.3:
        body["id"] = "r" + str(rng.randrange(1000))
    if rng.random() < 0.3:
        body["outputs"] = [{"name": o[0]} for o in MODELS[model][1]]
    return body


def _deep(rng: random.Random, depth: int, leaf: Any = 1) -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value] if rng.random() < 0.8 else {"a": value}
    return value


def mutate_json_request(rng: random.Random, body: dict[str, Any]) -> tuple[str, Any]:
    body = copy.deepcopy(body)
    inp = body["inputs"][0]
    op = rng.randrange(30)
    if op == 0:
        inp["shape"] = weird_shape(rng)
        return "shape", body
    if op == 1:
        inp["datatype"] = rng.choice([*DATATYPES, *WEIRD_STRINGS, None, 5, [], {}])
        return "datatype", body
    if op == 2:
        inp["data"] = weird_value(rng)
        return "data_type", body
    if op == 3:
        inp["data"] = _deep(rng, rng.choice([50, 99, 100, 101, 500, 5000]))
        inp["shape"] = [1] * rng.choice([1, 64, 65, 100])
        return "data_deep", body
    if op == 4:
        flat = inp["data"]
        if flat:
            flat[rng.randrange(len(flat))] = weird_value(rng)
        return "data_element", body
    if op == 5:
        inp["data"] = [rng.choice(HUGE_INTS + NEG_INTS)] * len(inp["data"])
        return "data_range", body
    if op == 6:
        inp["data"] = inp["data"] + inp["data"] if rng.random() < 0.5 else inp["data"][:-1]
        return "data_count", body
    if op == 7:
        inp["name"] = weird_value(rng) if rng.random() < 0.5 else rng.choice(WEIRD_STRINGS)
        return "name", body
    if op == 8:
        del inp[rng.choice(["name", "shape", "datatype", "data"])]
        return "missing_field", body
    if op == 9:
        body["parameters"] = {
            rng.choice(
                [
                    "binary_data_output",
                    "priority",
                    "timeout",
                    "sequence_id",
                    "sequence_start",
                    "sequence_end",
                    "triton_x",
                    "triton_enable_empty_final_response",
                    "custom",
                ]
            ): weird_value(rng)
            for _ in range(rng.randrange(1, 4))
        }
        return "request_params", body
    if op == 10:
        inp["parameters"] = rng.choice(
            [
                weird_value(rng),
                {"binary_data_size": weird_value(rng)},
                {"shared_memory_region": weird_value(rng)},
                {"shared_memory_byte_size": 4, "shared_memory_offset": weird_value(rng)},
                {"k": weird_value(rng)},
            ]
        )
        return "input_params", body
    if op == 11:
        name = rng.choice([o[0] for o in MODELS.get("add_sub", ([], [], 0))[1]] + WEIRD_STRINGS)
        params = rng.choice(
            [
                {"classification": weird_value(rng)},
                {"binary_data": weird_value(rng)},
                {"classification": rng.choice([1, 3, 2**31, 2**63 - 1])},
                {"shared_memory_region": "nope", "shared_memory_byte_size": weird_value(rng)},
                {"shared_memory_region": "nope", "shared_memory_byte_size": 64, "classification": 2},
                weird_value(rng),
            ]
        )
        body["outputs"] = [{"name": name, "parameters": params}] if rng.random() < 0.8 else weird_value(rng)
        return "outputs", body
    if op == 12:
        body["outputs"] = [{"name": n} for n in [rng.choice(["OUTPUT0", "features", "x"])] * 2]
        return "outputs_dup", body
    if op == 13:
        body["inputs"] = body["inputs"] + [copy.deepcopy(inp)]
        return "inputs_dup", body
    if op == 14:
        body["inputs"] = rng.choice([[], {}, None, "x", [None], [[]], [1]])
        return "inputs_type", body
    if op == 15:
        body["id"] = weird_value(rng)
        return "id", body
    if op == 16:
        inp["parameters"] = {
            "shared_memory_region": rng.choice(["nope", "fuzz_sys", "a" * 300]),
            "shared_memory_byte_size": rng.choice([0, 4, 64, 2**40, 2**63 - 1]),
            "shared_memory_offset": rng.choice([0, 8, 2**40, 2**63 - 1]),
        }
        del inp["data"]
        return "shm_ref", body
    if op == 17:
        return "top_level", rng.choice([[], None, "x", 1, [body], {"inputs": body}])
    if op == 18:
        inp["shape"] = [0] + [rng.choice(HUGE_INTS)] * rng.randrange(1, 3)
        inp["data"] = []
        return "zero_huge", body
    if op == 19:
        inp["shape"] = [1] * rng.choice([64, 65, 70, 128])
        inp["data"] = [1]
        return "many_dims", body
    if op == 20:
        inp["data"] = [inp["data"][:1], inp["data"][1:]]
        return "ragged", body
    if op == 21:
        inp["datatype"] = rng.choice(DATATYPES)
        return "wrong_datatype", body
    if op == 22:
        inp["data"] = [rng.choice(["1", True, None, 1.5, 2**64, -1, {}, [], "\ud800"]) for _ in inp["data"]]
        return "data_mixed", body
    if op == 23:
        inp["shape"] = [rng.choice(HUGE_INTS), *inp["shape"][1:]]
        return "batch_huge", body
    if op == 24:
        inp["shape"] = [0, *inp["shape"][1:]]
        inp["data"] = []
        return "batch_zero", body
    if op == 25:
        body["inputs"] = [inp] * rng.choice([2, 50, 1000])
        return "many_inputs", body
    if op == 26:
        inp["parameters"] = {"binary_data_size": rng.choice([0, 4, -1, 2**63])}
        return "binary_without_header", body
    if op == 27:
        body["inputs"][0] = _deep(rng, rng.choice([10, 1000, 100000]), inp)
        return "deep_input", body
    if op == 28:
        inp["shape"] = [rng.choice(HUGE_INTS), rng.choice(HUGE_INTS), 0]
        inp["data"] = []
        return "zero_elements_big_dims", body
    body[rng.choice(["inputs", "outputs", "parameters", "id"])] = weird_value(rng)
    return "field_type", body


def http_json_case(rng: random.Random) -> HttpCase:
    model = rng.choice(list(MODELS))
    path = _infer_path(rng, model)
    roll = rng.random()
    if roll < 0.65:
        kind, body = mutate_json_request(rng, http_json_valid(rng, model))
        if rng.random() < 0.3 and "deep" not in kind:
            with contextlib.suppress(KeyError, TypeError, IndexError, AttributeError):
                kind2, body2 = mutate_json_request(rng, body)
                kind, body = f"{kind}+{kind2}", body2
        try:
            data = json.dumps(body).encode()
        except (TypeError, ValueError, RecursionError):
            data = b'{"inputs": []}'
        return HttpCase("json_" + kind, "POST", path, data, {"Content-Type": "application/json"})
    if roll < 0.75:
        data = json.dumps(http_json_valid(rng, model)).encode()
        return HttpCase("json_bytes_mutated", "POST", path, mutate_bytes(rng, data))
    if roll < 0.8:
        text = rng.choice(
            [
                b"",
                b"{",
                b"[" * 100000,
                b'{"inputs":' + b"[" * 10000,
                b"1e99999",
                b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,16],"data":[1e999]}]}',
                b'{"inputs": NaN}',
                b"\x00" * 10,
                b"\xef\xbb\xbf{}",
                random_bytes(rng),
                b'{"a":"\\ud800"}',
                b'{"inputs":[{"name":"\\u0000"}]}',
            ]
        )
        return HttpCase("json_literal", "POST", path, text)
    if roll < 0.86:
        data = json.dumps(http_json_valid(rng, model)).encode()
        enc = rng.choice(["gzip", "deflate", "br", "gzip, deflate", "GZIP", "x" * 100])
        comp = gzip.compress(data) if enc.lower().startswith("gzip") else zlib.compress(data)
        choice = rng.randrange(4)
        if choice == 0:
            comp = comp[: rng.randrange(len(comp))]
        elif choice == 1:
            comp = mutate_bytes(rng, comp)
        elif choice == 2:
            comp = gzip.compress(b"[" * 200000)
        return HttpCase("json_encoding", "POST", path, comp, {"Content-Encoding": enc})
    if roll < 0.92:
        return other_http_case(rng)
    if roll < 0.96:
        name = rng.choice(
            [
                "nope",
                "add_sub%00",
                "a" * 2000,
                "%ff%fe",
                "..%2f..",
                "add_sub/versions/0",
                "add_sub/versions/99999999999999999999999",
            ]
        )
        tail = rng.choice(["/infer", "", "/ready", "/config", "/stats"])
        method = "POST" if tail == "/infer" else "GET"
        body = json.dumps(http_json_valid(rng, "add_sub")).encode()
        return HttpCase("json_model_path", method, f"/v2/models/{name}{tail}", body)
    return raw_http_case(rng)


def other_http_case(rng: random.Random) -> HttpCase:
    pick = rng.randrange(7)
    body = json.dumps(weird_value(rng)).encode() if rng.random() < 0.7 else mutate_bytes(rng, b'{"a": 1}')
    if pick == 0:
        reg = {
            "key": rng.choice(["/nope-fuzz", "", weird_value(rng)]),
            "byte_size": weird_value(rng),
            "offset": weird_value(rng),
        }
        data = json.dumps(reg).encode() if rng.random() < 0.6 else body
        return HttpCase(
            "shm_register",
            "POST",
            f"/v2/systemsharedmemory/region/{rng.choice(['r', 'x' * 300])}/register",
            data,
        )
    if pick == 1:
        return HttpCase(
            "shm_status",
            "GET",
            rng.choice(["/v2/systemsharedmemory/status", "/v2/systemsharedmemory/region/nope/status"]),
        )
    if pick == 2:
        return HttpCase("shm_unregister", "POST", "/v2/systemsharedmemory/region/nope-fuzz/unregister", body)
    if pick == 3:
        return HttpCase("repository_index", "POST", "/v2/repository/index", body)
    if pick == 4:
        # Only wrong shapes and types: valid settings would change the server's logging (log_file!).
        data = json.dumps(
            rng.choice(
                [
                    [],
                    "x",
                    1,
                    None,
                    [{"log_info": True}],
                    {"log_info": weird_value(rng)},
                    {"log_verbose_level": weird_value(rng)},
                    {"log_format": weird_value(rng)},
                    {"nope": 1},
                ]
            )
        ).encode()
        return HttpCase("logging", "POST", "/v2/logging", data)
    if pick == 5:
        return HttpCase("cuda_shm", "POST", "/v2/cudasharedmemory/region/x/register", body, allow_501=True)
    return HttpCase(
        "model_stats",
        "GET",
        rng.choice(["/v2/models/nope/stats", "/v2/models/stats", "/v2/models/add_sub/versions/7/stats"]),
    )


def raw_http_case(rng: random.Random) -> HttpCase:
    choice = rng.randrange(6)
    if choice == 0:
        raw = random_bytes(rng, 300)
    elif choice == 1:
        raw = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    elif choice == 2:
        raw = (
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + rng.choice([b"zz\r\n", b"ffffffffffffffff\r\nab", b"5\r\nabc\r\n0\r\n\r\n"])
        )
    elif choice == 3:
        raw = b"GET /" + b"a" * rng.choice([100, 10000, 100000]) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    elif choice == 4:
        raw = b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"b" * 20000 + b"\r\n\r\n"
    else:
        raw = mutate_bytes(rng, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    return HttpCase("raw_http", "RAW", "", raw=raw)


def http_binary_case(rng: random.Random) -> HttpCase:
    model = rng.choice(list(MODELS))
    path = _infer_path(rng, model)
    inputs = valid_inputs(rng, model)
    header: dict[str, Any] = {"inputs": []}
    blobs: list[bytes] = []
    for name, datatype, shape, array in inputs:
        blob = wire_bytes(array, datatype)
        header["inputs"].append(
            {
                "name": name,
                "datatype": datatype,
                "shape": shape,
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    if rng.random() < 0.5:
        header["parameters"] = {"binary_data_output": True}
    op = rng.randrange(14)
    kind = "binary"
    length_header: str | None = None
    first = header["inputs"][0]
    if op == 0:
        first["parameters"]["binary_data_size"] = rng.choice(
            [0, 1, 3, len(blobs[0]) + 1, 2**40, 2**63, -1, "4", None, 1.5, True]
        )
        kind = "binary_size_lie"
    elif op == 1:
        blobs[0] = blobs[0][: rng.randrange(len(blobs[0]) + 1)]
        kind = "binary_truncated"
    elif op == 2:
        blobs.append(random_bytes(rng, 40) or b"x")
        kind = "binary_trailing"
    elif op == 3:
        first["shape"] = weird_shape(rng)
        kind = "binary_shape"
    elif op == 4 and first["datatype"] == "BYTES":
        blobs[0] = struct.pack("<I", rng.choice([2**32 - 1, 2**31, 100, 5])) + random_bytes(rng, 8)
        first["parameters"]["binary_data_size"] = len(blobs[0])
        kind = "binary_bytes_lie"
    elif op == 5:
        length_header = rng.choice(
            ["-1", "abc", "", " 5 ", "99999999999999999999", "1e3", "0x10", "+3", "١٢", "9" * 5000]
        )
        kind = "binary_header_length_garbage"
    elif op == 6:
        length_header = "0"  # raw binary request: the whole body is the one input
        blobs = [mutate_bytes(rng, b"".join(blobs)) if rng.random() < 0.5 else b"".join(blobs)]
        kind = "binary_raw"
    elif op == 7:
        first["datatype"] = rng.choice(DATATYPES)
        kind = "binary_datatype"
    elif op == 8:
        first["parameters"]["binary_data_size"] = len(blobs[0])
        first["data"] = [1]
        kind = "binary_and_data"
    elif op == 9:
        first["parameters"]["shared_memory_region"] = "nope"
        kind = "binary_and_shm"
    elif op == 10:
        header["outputs"] = [
            {
                "name": rng.choice(["OUTPUT0", "OUTPUT1", "features", "zz"]),
                "parameters": {
                    "binary_data": rng.choice([True, False, 1, "yes"]),
                    "classification": rng.choice([0, 1, 2, 5, -1]),
                },
            }
        ]
        kind = "binary_outputs"
    elif op == 11:
        first["shape"] = [1] * rng.choice([64, 65, 100])
        kind = "binary_many_dims"
    elif op == 12:
        first["shape"] = [rng.choice(HUGE_INTS), 0]
        first["parameters"]["binary_data_size"] = 0
        blobs[0] = b""
        kind = "binary_zero_huge"
    head = json.dumps(header).encode()
    if length_header is None:
        length_header = str(len(head) + rng.choice([0, 0, 0, 0, -1, 1, -len(head), 10**6]))
    if length_header == "0":
        head = b""
    body = head + b"".join(blobs)
    if rng.random() < 0.1:
        body = mutate_bytes(rng, body)
        kind += "+mutated"
    headers = {"Inference-Header-Content-Length": length_header, "Content-Type": "application/octet-stream"}
    return HttpCase(kind, "POST", path, body, headers)


# == gRPC ============================================================================================
@dataclass
class GrpcCase:
    kind: str
    method: str  # e.g. "ModelInfer"
    payload: bytes
    parsed_ok: bool  # False when the bytes may not parse (INTERNAL "Unable to parse request" allowed)


def grpc_valid_request(rng: random.Random, model: str, use_raw: bool) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape, array in valid_inputs(rng, model):
        tensor = msg.inputs.add(name=name, datatype=datatype, shape=shape)
        if use_raw or datatype == "FP16":
            msg.raw_input_contents.append(wire_bytes(array, datatype))
        else:
            field_name = {
                "BYTES": "bytes_contents",
                "BOOL": "bool_contents",
                "INT64": "int64_contents",
                "FP32": "fp32_contents",
                "UINT8": "uint_contents",
            }[datatype]
            getattr(tensor.contents, field_name).extend(array.reshape(-1).tolist())
    return msg


def _set_param(p: service_pb2.InferParameter, rng: random.Random) -> None:
    kind = rng.randrange(5)
    if kind == 0:
        p.bool_param = rng.random() < 0.5
    elif kind == 1:
        p.int64_param = rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**40])
    elif kind == 2:
        p.string_param = rng.choice(PB_STRINGS)
    elif kind == 3:
        p.double_param = rng.choice([0.5, float("nan"), float("inf")])
    elif kind == 4:
        p.uint64_param = rng.choice([0, 2**64 - 1, 2**63])


def mutate_grpc_request(rng: random.Random, msg: service_pb2.ModelInferRequest) -> str:
    if not msg.inputs:
        msg.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        return "input_without_data"
    tensor = msg.inputs[0]
    op = rng.randrange(20)
    if op == 0:
        del tensor.shape[:]
        tensor.shape.extend([rng.choice(NEG_INTS[:4])] + [1] * rng.randrange(0, 3))
        return "shape_negative"
    if op == 1:
        del tensor.shape[:]
        tensor.shape.extend([1, rng.choice([2**40 + 1, 2**41, 2**62, 2**63 - 1])])
        return "shape_huge"
    if op == 2:
        del tensor.shape[:]
        tensor.shape.extend([1] * rng.choice([64, 65, 100, 1000]))
        return "shape_many_dims"
    if op == 3:
        del tensor.shape[:]
        tensor.shape.extend([0, rng.choice([2**40, 2**62, 2**63 - 1]), rng.choice([2**40, 2**62, 2**63 - 1])])
        return "shape_zero_huge"
    if op == 4:
        tensor.datatype = rng.choice([*DATATYPES, *PB_STRINGS])
        return "datatype"
    if op == 5:
        if msg.raw_input_contents:
            i = rng.randrange(len(msg.raw_input_contents))
            msg.raw_input_contents[i] = mutate_bytes(rng, msg.raw_input_contents[i])
        return "raw_mutated"
    if op == 6:
        msg.raw_input_contents.append(random_bytes(rng, 32))
        return "raw_extra"
    if op == 7:
        del msg.raw_input_contents[:]
        return "raw_missing"
    if op == 8:
        field_name = rng.choice(
            [
                "bool_contents",
                "int_contents",
                "int64_contents",
                "uint_contents",
                "uint64_contents",
                "fp32_contents",
                "fp64_contents",
                "bytes_contents",
            ]
        )
        values = {
            "bool_contents": [True],
            "int_contents": [-(2**31), 2**31 - 1],
            "int64_contents": [-1, 2**63 - 1],
            "uint_contents": [2**32 - 1, 7],
            "uint64_contents": [2**64 - 1],
            "fp32_contents": [1e38, float("nan")],
            "fp64_contents": [1e308],
            "bytes_contents": [b"\xff"],
        }[field_name]
        getattr(tensor.contents, field_name).extend(values * rng.randrange(1, 20))
        if rng.random() < 0.5:
            del msg.raw_input_contents[:]
        return "contents"
    if op == 9:
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice(
                [
                    "sequence_id",
                    "sequence_start",
                    "sequence_end",
                    "priority",
                    "timeout",
                    "triton_enable_empty_final_response",
                    "triton_x",
                    "custom",
                    "",
                ]
            )
            _set_param(msg.parameters[key], rng)
        return "request_params"
    if op == 10:
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice(
                [
                    "shared_memory_region",
                    "shared_memory_byte_size",
                    "shared_memory_offset",
                    "binary_data_size",
                    "x",
                ]
            )
            _set_param(tensor.parameters[key], rng)
        return "input_params"
    if op == 11:
        out = msg.outputs.add(name=rng.choice(["OUTPUT0", "OUTPUT1", "features", "", "zz"]))
        for _ in range(rng.randrange(0, 3)):
            key = rng.choice(
                [
                    "classification",
                    "shared_memory_region",
                    "shared_memory_byte_size",
                    "shared_memory_offset",
                    "binary_data",
                ]
            )
            _set_param(out.parameters[key], rng)
        if rng.random() < 0.3:
            msg.outputs.add(name=out.name)
        return "outputs"
    if op == 12:
        tensor.parameters["shared_memory_region"].string_param = rng.choice(["nope", "fuzz_sys"])
        tensor.parameters["shared_memory_byte_size"].int64_param = rng.choice([0, 64, 2**40, 2**63 - 1])
        tensor.parameters["shared_memory_offset"].int64_param = rng.choice([0, 2**40, 2**63 - 1])
        return "shm_ref"
    if op == 13:
        msg.inputs.add().CopyFrom(tensor)
        return "inputs_dup"
    if op == 14:
        del msg.inputs[:]
        return "no_inputs"
    if op == 15:
        tensor.name = rng.choice(PB_STRINGS)
        return "name"
    if op == 16:
        msg.model_name = rng.choice(["", "nope", "a" * 3000, "add_sub\x00"])
        msg.model_version = rng.choice(["", "0", "-1", "99999999999999999999", "x"])
        return "model"
    if op == 17:
        del tensor.shape[:]
        tensor.shape.extend([rng.choice(HUGE_INTS[:7]), 16])
        return "batch_huge"
    if op == 18:
        del tensor.shape[:]
        return "shape_empty"
    tensor.ClearField("contents")
    del msg.raw_input_contents[:]
    tensor.contents.bytes_contents.extend([b"a"] * rng.randrange(0, 5))
    return "contents_wrong_field"


def grpc_infer_payload(rng: random.Random) -> tuple[str, bytes, bool]:
    model = rng.choice(list(MODELS))
    msg = grpc_valid_request(rng, model, use_raw=rng.random() < 0.6)
    kind = mutate_grpc_request(rng, msg)
    if rng.random() < 0.2:
        kind += "+" + mutate_grpc_request(rng, msg)
    if rng.random() < 0.05:  # past the raw-scan threshold (64 KiB): the split_raw_inputs path
        msg.raw_input_contents.append(b"\0" * 70000)
        kind += "+big"
    data = msg.SerializeToString()
    roll = rng.random()
    if roll < 0.12:
        return "bytes_mutated_" + kind, mutate_bytes(rng, data), False
    if roll < 0.15:
        return "random_bytes", random_bytes(rng), False
    if roll < 0.17:  # a big message that does not parse
        return "big_mutated", mutate_bytes(rng, data + b"\x3a\x80\x80\x04" + b"\0" * 70000), False
    return kind, data, True


def grpc_unary_case(rng: random.Random) -> GrpcCase:
    roll = rng.random()
    if roll < 0.85:
        kind, data, ok = grpc_infer_payload(rng)
        return GrpcCase(kind, "ModelInfer", data, ok)
    method = rng.choice(
        [
            "ModelMetadata",
            "ModelReady",
            "ModelConfig",
            "ModelStatistics",
            "SystemSharedMemoryRegister",
            "SystemSharedMemoryStatus",
            "RepositoryIndex",
            "CudaSharedMemoryStatus",
            "LogSettings",
        ]
    )
    if method == "SystemSharedMemoryRegister":
        msg: Any = service_pb2.SystemSharedMemoryRegisterRequest(
            name=rng.choice(["r", "", "x" * 300]),
            key=rng.choice(["/nope-fuzz", "", "\x00"]),
            offset=rng.choice([0, 2**63]),
            byte_size=rng.choice([0, 1, 2**64 - 1]),
        )
    elif method == "LogSettings":
        msg = service_pb2.LogSettingsRequest()
        msg.settings[
            rng.choice(["log_info", "log_verbose_level", "log_format", "nope"])
        ].string_param = "x\x00"
    elif method in ("SystemSharedMemoryStatus", "CudaSharedMemoryStatus"):
        msg = getattr(service_pb2, method + "Request")(name=rng.choice(["", "nope"]))
    elif method == "RepositoryIndex":
        msg = service_pb2.RepositoryIndexRequest(repository_name=rng.choice(["", "x"]), ready=True)
    else:
        msg = getattr(service_pb2, method + "Request")(
            name=rng.choice(["add_sub", "nope", "", "a" * 2000]),
            version=rng.choice(["", "1", "-1", "x", "9" * 30]),
        )
    data = msg.SerializeToString()
    if rng.random() < 0.3:
        return GrpcCase(method + "_mutated", method, mutate_bytes(rng, data), False)
    return GrpcCase(method, method, data, True)


@dataclass
class StreamCase:
    kind: str
    payloads: list[tuple[str, bytes, bool]]
    error_mode: bool  # triton_grpc_error: the stream ends with a status code on the first error


def grpc_stream_case(rng: random.Random) -> StreamCase:
    payloads = []
    for _ in range(rng.randrange(1, 8)):
        if rng.random() < 0.25:
            model = rng.choice(list(MODELS))
            payloads.append(("valid", grpc_valid_request(rng, model, True).SerializeToString(), True))
        else:
            payloads.append(grpc_infer_payload(rng))
    return StreamCase(
        "+".join(sorted({p[0].split("+")[0] for p in payloads}))[:80], payloads, rng.random() < 0.4
    )


# == ZeroMQ ==========================================================================================
@dataclass
class ZmqCase:
    kind: str
    frames: list[bytes]
    expect_reply: bool = True


def zmq_valid(rng: random.Random, model: str) -> tuple[dict[str, Any], list[bytes]]:
    header: dict[str, Any] = {"v": 1, "op": "infer", "id": rng.randrange(10**6), "model": model, "inputs": []}
    frames = []
    for name, datatype, shape, array in valid_inputs(rng, model):
        header["inputs"].append({"name": name, "datatype": datatype, "shape": shape})
        frames.append(wire_bytes(array, datatype))
    return header, frames


def zmq_case(rng: random.Random, ring: dict[str, Any] | None = None) -> ZmqCase:
    model = rng.choice(list(MODELS))
    header, frames = zmq_valid(rng, model)
    inp = header["inputs"][0]
    op = rng.randrange(24)
    kind = "zmq"
    if op == 0:
        inp["shape"] = weird_shape(rng)
        kind = "shape"
    elif op == 1:
        inp["datatype"] = rng.choice([*DATATYPES, *WEIRD_STRINGS[:8], 5, None])
        kind = "datatype"
    elif op == 2:
        frames = frames[:-1] if rng.random() < 0.5 else [*frames, random_bytes(rng, 20)]
        kind = "frame_count"
    elif op == 3:
        frames[0] = mutate_bytes(rng, frames[0])
        kind = "frame_mutated"
    elif op == 4:
        header[
            rng.choice(
                [
                    "v",
                    "op",
                    "id",
                    "model",
                    "version",
                    "inputs",
                    "outputs",
                    "parameters",
                    "priority",
                    "timeout_us",
                ]
            )
        ] = weird_value(rng)
        kind = "field_type"
    elif op == 5:
        del header[rng.choice(["v", "op", "model", "inputs"])]
        kind = "missing_field"
    elif op == 6:
        inp["shm"] = rng.choice(
            [
                weird_value(rng),
                {"region": "nope", "byte_size": 4},
                {"region": "nope", "byte_size": weird_value(rng), "offset": weird_value(rng)},
                {"region": 5, "byte_size": 1},
                {"region": "nope", "byte_size": 8, "slot": 0},
            ]
        )
        frames = frames[1:]
        kind = "shm_ref"
    elif op == 7:
        header["outputs"] = rng.choice(
            [
                [{"name": "OUTPUT0", "classification": weird_value(rng)}],
                [{"name": weird_value(rng)}],
                [weird_value(rng)],
                [{"name": "OUTPUT0", "shm": weird_value(rng)}],
                [{"name": "OUTPUT0", "classification": 2, "shm": {"region": "nope", "byte_size": 8}}],
                [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}],
            ]
        )
        kind = "outputs"
    elif op == 8:
        head = json.dumps(header).encode()
        return ZmqCase("header_mutated", [mutate_bytes(rng, head), *frames])
    elif op == 9:
        return ZmqCase("header_random", [random_bytes(rng, 200), *frames])
    elif op == 10:
        literal = rng.choice(
            [
                b"",
                b"[]",
                b"null",
                b"1",
                b'"x"',
                b"[" * 100000,
                b'{"v":' + b"[" * 5000,
                b'{"v": 1, "op": "infer", "model": "\xff"}',
                b"\xff\xfe",
                b'{"v": 1e999}',
                b'{"v": NaN}',
                b'{"v": 1, "op": "ping", "id": 1e99999}',
            ]
        )
        return ZmqCase("header_literal", [literal, *frames])
    elif op == 11:
        header = {
            "v": 1,
            "op": rng.choice(
                [
                    "register",
                    "unregister",
                    "status",
                    "metadata",
                    "ready",
                    "ping",
                    "nope",
                    5,
                    None,
                    "probe",
                    "",
                ]
            ),
            "id": weird_value(rng),
        }
        for key in rng.sample(
            ["name", "key", "offset", "byte_size", "model", "version"], rng.randrange(0, 6)
        ):
            header[key] = rng.choice([weird_value(rng), "nope", "/nope-fuzz", 0, 64])
        frames = []
        kind = "control"
    elif op == 12:
        inp["shape"] = [1] * rng.choice([64, 65, 100])
        kind = "many_dims"
    elif op == 13 and inp["datatype"] == "BYTES":
        frames[0] = struct.pack("<I", rng.choice([2**32 - 1, 2**31, 50])) + random_bytes(rng, 8)
        kind = "bytes_lie"
    elif op == 14:
        inp["shape"] = [0, rng.choice(HUGE_INTS)]
        frames[0] = b""
        kind = "zero_huge"
    elif op == 15:
        header["v"] = rng.choice([0, 2, "1", 1.0, None, True])
        kind = "version"
    elif op == 16:
        frames = frames + [b""] * rng.randrange(1, 50)
        kind = "extra_frames"
    elif op == 17:
        return ZmqCase("empty_delimiter_only", [b""], expect_reply=False)
    elif op == 18:
        header["inputs"] = [inp] * rng.choice([2, 100])
        kind = "inputs_dup"
    elif op == 19:
        inp["parameters"] = weird_value(rng)
        kind = "input_params"
    elif op == 20:
        header["parameters"] = {
            "sequence_id": weird_value(rng),
            "sequence_start": weird_value(rng),
            "k": weird_value(rng),
        }
        kind = "request_params"
    elif op == 21:
        inp["shape"] = [rng.choice(HUGE_INTS), *inp["shape"][1:]]
        kind = "batch_huge"
    elif op == 22 and ring is not None:
        return ring_case(rng, ring)
    try:
        head = json.dumps(header).encode()
    except (TypeError, ValueError):
        head = b"{}"
    return ZmqCase(kind, [head, *frames])


def ring_case(rng: random.Random, ring: dict[str, Any]) -> ZmqCase:
    """References into a real, registered frame ring with lying slot/gen/offset/byte_size."""
    slots, slot_size = ring["slots"], ring["slot_size"]
    shape = [1, rng.choice([4, 16, 1, 2**20])]
    ref: dict[str, Any] = {
        "region": ring["name"],
        "slot": rng.choice([0, 1, slots - 1, slots, -1, 2**31, 2**63]),
        "gen": rng.choice([0, 1, -1, 2**64, 2**63]),
        "byte_size": rng.choice([0, 16, slot_size, slot_size + 1, 2**40, -1]),
        "offset": rng.choice([0, 4, slot_size, slot_size - 4, -4, 2**62]),
    }
    for key in rng.sample(list(ref), rng.randrange(0, 2)):
        ref[key] = weird_value(rng)
    header: dict[str, Any] = {
        "v": 1,
        "op": "infer",
        "id": 1,
        "model": "id_fp16",
        "inputs": [{"name": "INPUT0", "datatype": "FP16", "shape": shape, "shm": ref}],
    }
    if rng.random() < 0.3:
        header["outputs"] = [{"name": "OUTPUT0", "shm": dict(ref)}]
    try:
        head = json.dumps(header).encode()
    except (TypeError, ValueError):
        head = b"{}"
    return ZmqCase("ring_ref", [head])
