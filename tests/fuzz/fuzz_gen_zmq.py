"""Malformed and adversarial ZeroMQ requests (headers, frames, shared-memory and camera-ring
references); see fuzz_gen.py for the shared pieces.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from typing import Any

from fuzz_gen import (
    DATATYPES,
    HUGE_INTS,
    MODELS,
    WEIRD_STRINGS,
    mutate_bytes,
    random_bytes,
    valid_inputs,
    weird_shape,
    weird_value,
    wire_bytes,
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
