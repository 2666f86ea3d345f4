"""Malformed and adversarial HTTP requests (KServe V2 JSON, the binary-tensor extension, the other
endpoints, raw bytes on the socket); see fuzz_gen.py for the shared pieces.
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

from fuzz_gen import (
    DATATYPES,
    HUGE_INTS,
    MODELS,
    NEG_INTS,
    WEIRD_STRINGS,
    json_data,
    mutate_bytes,
    random_bytes,
    valid_inputs,
    weird_shape,
    weird_value,
    wire_bytes,
)


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
