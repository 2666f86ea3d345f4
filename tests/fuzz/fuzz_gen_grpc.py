"""Malformed and adversarial gRPC requests (ModelInfer messages broken field by field, unary and
streamed); see fuzz_gen.py for the shared pieces.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from fuzz_gen import (
    DATATYPES,
    HUGE_INTS,
    MODELS,
    NEG_INTS,
    PB_STRINGS,
    mutate_bytes,
    random_bytes,
    valid_inputs,
    wire_bytes,
)
from tritonclient.grpc import service_pb2


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


REQUEST_PARAMS = [
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
INPUT_PARAMS = [
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
    "binary_data_size",
    "x",
]
OUTPUT_PARAMS = [
    "classification",
    "shared_memory_region",
    "shared_memory_byte_size",
    "shared_memory_offset",
    "binary_data",
]


def _set_params(params: Any, keys: list[str], rng: random.Random, least: int, below: int) -> None:
    """Between `least` and `below` - 1 random parameters named from `keys`, each given a random value."""
    for _ in range(rng.randrange(least, below)):
        _set_param(params[rng.choice(keys)], rng)


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
        _set_params(msg.parameters, REQUEST_PARAMS, rng, 1, 4)
        return "request_params"
    if op == 10:
        _set_params(tensor.parameters, INPUT_PARAMS, rng, 1, 4)
        return "input_params"
    if op == 11:
        out = msg.outputs.add(name=rng.choice(["OUTPUT0", "OUTPUT1", "features", "", "zz"]))
        _set_params(out.parameters, OUTPUT_PARAMS, rng, 0, 3)
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
