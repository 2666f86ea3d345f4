"""The HTTP tensor codec alone: JSON and binary tensors in, responses out (no server)."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from edgeserve.frontends.http import codec
from edgeserve.frontends.http.admin import config_to_json
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InferResponse, OutputTensor, RequestedOutput, ShmRef


def body_of(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, int | None]:
    text = json.dumps(header).encode()
    if not blobs:
        return text, None
    return text + b"".join(blobs), len(text)


def decode(header: dict[str, Any], *blobs: bytes) -> tuple[InferRequest, bool]:
    body, length = body_of(header, *blobs)
    return codec.decode_request("m", "", body, length)


def bad(header: dict[str, Any] | bytes, *blobs: bytes, length: int | None = None) -> str:
    if isinstance(header, bytes):
        body = header
    else:
        body, computed = body_of(header, *blobs)
        length = computed if length is None else length
    with pytest.raises(InferenceError) as info:
        codec.decode_request("m", "", body, length)
    assert info.value.status is Status.INVALID_ARG
    return info.value.message


def test_json_nested_and_flat_data_give_the_same_array() -> None:
    nested, _ = decode(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]}]}
    )
    flat, _ = decode(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}]}
    )
    for request in (nested, flat):
        data = request.inputs[0].data
        assert data is not None and data.dtype == np.float32 and data.shape == (2, 3)
        np.testing.assert_array_equal(data, np.arange(1, 7, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("BOOL", [True, False]),
        ("INT8", [-128, 127]),
        ("UINT64", [0, 2**64 - 1]),
        ("INT64", [-(2**63), 5]),
        ("FP16", [0.5, -2]),
        ("FP64", [1e300, 0.25]),
        ("BF16", [1.5, -3.0]),
        ("UINT8", [0, 255]),
    ],
)
def test_json_datatypes(datatype: str, values: list[Any]) -> None:
    request, _ = decode({"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": values}]})
    data = request.inputs[0].data
    dtype = datatypes.numpy_dtype(datatype)
    assert data is not None and data.dtype == dtype
    assert data.tolist() == np.array(values, dtype=dtype).tolist()


def test_json_bytes_are_strings() -> None:
    request, _ = decode(
        {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": [["héllo", ""]]}]}
    )
    data = request.inputs[0].data
    assert data is not None and data.shape == (1, 2) and data.tolist() == [["héllo".encode(), b""]]


@pytest.mark.parametrize(
    ("datatype", "values", "needle"),
    [
        ("INT32", [1.5, 2], "must be integers"),
        ("BOOL", [1, 0], "true/false"),
        ("FP32", ["a", "b"], "numbers"),
        ("INT8", [1, 300], "out of range"),
        ("BYTES", [1, "a"], "JSON string"),
        ("UINT8", [-1, 2], "out of range"),
        ("FP32", [None, 1], "numbers"),
        ("FP32", [[1], 2, [3, 4]], "elements"),
    ],
)
def test_json_wrong_types_are_rejected(datatype: str, values: list[Any], needle: str) -> None:
    shape = [3] if len(values) == 3 else [2]
    message = bad({"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": values}]})
    assert needle in message and "input 'x'" in message


def test_element_count_mismatch_says_both_counts() -> None:
    message = bad({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]}]})
    assert "has 3" in message and "needs 4" in message


def test_nesting_deeper_than_100_is_rejected() -> None:
    data: Any = [1.0]
    for _ in range(120):
        data = [data]
    message = bad({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": data}]})
    assert "deeper than 100" in message


def test_binary_inputs_are_views_into_the_body() -> None:
    a = np.arange(6, dtype=np.float32)
    b = np.array([7, 8], dtype=np.int64)
    header = {
        "inputs": [
            {"name": "a", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
            {"name": "b", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": b.nbytes}},
        ]
    }
    body, length = body_of(header, a.tobytes(), b.tobytes())
    request, binary_out = codec.decode_request("m", "1", body, length)
    assert not binary_out and request.model_version == "1"
    got_a, got_b = request.inputs[0].data, request.inputs[1].data
    assert got_a is not None and got_b is not None
    np.testing.assert_array_equal(got_a, a.reshape(2, 3))
    np.testing.assert_array_equal(got_b, b)
    assert np.shares_memory(got_a, np.frombuffer(body, dtype=np.uint8))  # zero-copy
    assert "binary_data_size" not in request.inputs[0].parameters


def test_binary_bytes_input() -> None:
    payload = datatypes.serialize_bytes(np.array([b"ab", b"c"], dtype=np.object_))
    request, _ = decode(
        {
            "inputs": [
                {
                    "name": "s",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(payload)},
                }
            ]
        },
        payload,
    )
    data = request.inputs[0].data
    assert data is not None and data.tolist() == [b"ab", b"c"]


def test_huge_bytes_shape_is_rejected_before_allocating() -> None:
    header = {
        "inputs": [
            {"name": "s", "datatype": "BYTES", "shape": [10**12], "parameters": {"binary_data_size": 4}}
        ]
    }
    assert "BYTES elements" in bad(header, b"\0\0\0\0")


def test_binary_size_errors() -> None:
    header = {
        "inputs": [{"name": "a", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 12}}]
    }
    assert "expected 16" in bad(header, b"\0" * 12)
    assert "runs past the end" in bad(header, b"\0" * 8)
    header["inputs"][0]["parameters"]["binary_data_size"] = 16
    assert "additional input data" in bad(header, b"\0" * 20)
    text = json.dumps(header).encode()
    assert "no Inference-Header-Content-Length" in bad(text, length=None)


def test_exactly_one_data_source_per_input() -> None:
    both = {"name": "a", "datatype": "FP32", "shape": [1], "data": [1], "parameters": {"binary_data_size": 4}}
    assert "exactly one" in bad({"inputs": [both]}, struct.pack("<f", 1))
    assert "got none" in bad({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]})
    shm_and_data = {
        "name": "a",
        "datatype": "FP32",
        "shape": [1],
        "data": [1],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4},
    }
    assert "exactly one" in bad({"inputs": [shm_and_data]})


def test_shared_memory_references() -> None:
    request, _ = decode(
        {
            "inputs": [
                {
                    "name": "a",
                    "datatype": "FP32",
                    "shape": [4],
                    "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 16},
                }
            ],
            "outputs": [
                {
                    "name": "o",
                    "parameters": {
                        "shared_memory_region": "out",
                        "shared_memory_byte_size": 64,
                        "shared_memory_offset": 128,
                        "binary_data": False,
                    },
                }
            ],
        }
    )
    assert request.inputs[0].shm == ShmRef("in", 16, 0) and request.inputs[0].data is None
    assert request.outputs is not None and request.outputs[0].shm == ShmRef("out", 64, 128)
    no_size = {"name": "a", "datatype": "FP32", "shape": [4], "parameters": {"shared_memory_region": "in"}}
    assert "needs shared_memory_byte_size" in bad({"inputs": [no_size]})
    no_region = {
        "name": "a",
        "datatype": "FP32",
        "shape": [4],
        "data": [1, 2, 3, 4],
        "parameters": {"shared_memory_byte_size": 16},
    }
    assert "without shared_memory_region" in bad({"inputs": [no_region]})
    good_input = {"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}
    shm_binary = {
        "name": "o",
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4, "binary_data": True},
    }
    assert "binary_data" in bad({"inputs": [good_input], "outputs": [shm_binary]})


def test_request_parameters() -> None:
    request, binary_out = decode(
        {
            "id": "r1",
            "parameters": {
                "priority": 1,
                "timeout": 5000,
                "binary_data_output": True,
                "sequence_id": "abc",
                "sequence_start": True,
                "sequence_end": False,
                "custom": 2.5,
            },
            "inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
            "outputs": [
                {"name": "o", "parameters": {"classification": 3}},
                {"name": "p", "parameters": {"binary_data": False}},
            ],
        }
    )
    assert request.id == "r1" and request.priority == 1 and request.timeout_us == 5000 and binary_out
    assert request.parameters["sequence_id"] == "abc" and request.parameters["custom"] == 2.5
    assert request.outputs == [RequestedOutput("o", classification=3), RequestedOutput("p", binary=False)]
    good = [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]
    assert "priority" in bad({"parameters": {"priority": -1}, "inputs": good})
    assert "timeout" in bad({"parameters": {"timeout": "soon"}, "inputs": good})
    assert "reserved" in bad({"parameters": {"triton_foo": 1}, "inputs": good})
    assert "sequence_id" in bad({"parameters": {"sequence_start": True}, "inputs": good})
    assert "'id'" in bad({"id": 5, "inputs": good})
    assert "custom" in bad({"parameters": {"custom": [1]}, "inputs": good})


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "failed to parse"),
        (b"[1, 2]", "must be a JSON object"),
        (b"{}", "'inputs'"),
        (b'{"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}', "'name'"),
        (b'{"inputs": [{"name": "a", "datatype": "FP33", "shape": [1], "data": [1]}]}', "unknown datatype"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": [1]}]}', "shape"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "data": [1]}]}', "'shape'"),
        (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": 1}]}', "JSON array"),
        (
            b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": {}}',
            "'outputs'",
        ),
        (b"\xff\xfe", "failed to parse"),
        (b"[" * 5000 + b"]" * 5000, "JSON"),
    ],
)
def test_malformed_json_is_a_clear_400(body: bytes, needle: str) -> None:
    assert needle in bad(body)


def test_header_length_checks() -> None:
    assert codec.parse_header_length(None, 10) is None
    assert codec.parse_header_length("4", 10) == 4
    for value in ("x", "-1", "11"):
        with pytest.raises(InferenceError, match="Inference-Header-Content-Length"):
            codec.parse_header_length(value, 10)


def _config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_raw_binary_request_single_input() -> None:
    config = _config('max_batch_size: 8 input { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] }')
    data = np.arange(12, dtype=np.float32)
    request = codec.decode_raw_request("m", "", data.tobytes(), config)
    tensor = request.inputs[0]
    assert tensor.name == "x" and tensor.shape == (1, 3, 4)
    assert tensor.data is not None
    np.testing.assert_array_equal(tensor.data.reshape(-1), data)
    with pytest.raises(InferenceError, match="do not fit"):
        codec.decode_raw_request("m", "", b"\0" * 10, config)
    two = _config(
        'input { name: "a" data_type: TYPE_FP32 dims: 1 } input { name: "b" data_type: TYPE_FP32 dims: 1 }'
    )
    with pytest.raises(InferenceError, match="exactly one input"):
        codec.decode_raw_request("m", "", b"\0" * 4, two)
    text = _config('input { name: "t" data_type: TYPE_STRING dims: 1 }')
    request = codec.decode_raw_request("m", "", b"hello", text)
    assert request.inputs[0].data is not None and request.inputs[0].data.tolist() == [b"hello"]


def _response() -> InferResponse:
    response = InferResponse("m", "3", "req-7")
    response.outputs.append(OutputTensor("f", "FP32", (2, 2), np.array([[1, 2], [3, 4]], dtype=np.float32)))
    response.outputs.append(
        OutputTensor("s", "BYTES", (2,), np.array([b"x", "yé".encode()], dtype=np.object_))
    )
    response.outputs.append(OutputTensor("b", "BOOL", (1,), np.array([True])))
    response.outputs.append(OutputTensor("m", "FP32", (4,), None, shm=ShmRef("out", 16, 32)))
    return response


def test_encode_json_response() -> None:
    chunks, length = codec.encode_response(_response(), InferRequest("m"), binary_default=False)
    assert length is None and len(chunks) == 1
    body = json.loads(bytes(chunks[0]))
    assert body["model_name"] == "m" and body["model_version"] == "3" and body["id"] == "req-7"
    outs = {o["name"]: o for o in body["outputs"]}
    assert outs["f"] == {"name": "f", "datatype": "FP32", "shape": [2, 2], "data": [1.0, 2.0, 3.0, 4.0]}
    assert outs["s"]["data"] == ["x", "yé"] and outs["b"]["data"] == [True]
    assert "data" not in outs["m"]
    assert outs["m"]["parameters"] == {
        "shared_memory_region": "out",
        "shared_memory_byte_size": 16,
        "shared_memory_offset": 32,
    }


def test_encode_binary_response_with_per_output_override() -> None:
    request = InferRequest(
        "m",
        outputs=[
            RequestedOutput("f"),
            RequestedOutput("s", binary=False),
            RequestedOutput("b", binary=True),
            RequestedOutput("m"),
        ],
    )
    chunks, length = codec.encode_response(_response(), request, binary_default=True)
    assert length is not None
    body = b"".join(bytes(c) for c in chunks)
    header = json.loads(body[:length])
    outs = {o["name"]: o for o in header["outputs"]}
    assert outs["f"]["parameters"] == {"binary_data_size": 16} and "data" not in outs["f"]
    assert outs["s"]["data"] == ["x", "yé"]
    assert outs["b"]["parameters"] == {"binary_data_size": 1}
    rest = body[length:]
    np.testing.assert_array_equal(np.frombuffer(rest[:16], dtype=np.float32), [1, 2, 3, 4])
    assert rest[16:] == b"\x01"


def test_config_json_matches_triton_conventions() -> None:
    config = _config(
        'name: "m" max_batch_size: 8'
        ' input { name: "x" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, -1] }'
        " dynamic_batching { preferred_batch_size: [4, 8] max_queue_delay_microseconds: 100 }"
        " version_policy { specific { versions: [1, 3] } }"
        ' model_warmup { name: "w" batch_size: 1 inputs { key: "x" value { data_type: TYPE_FP32 dims: [3, 8]'
        " zero_data: true } } }"
    )
    doc = config_to_json(config)
    assert doc["input"][0]["dims"] == [3, -1] and doc["input"][0]["data_type"] == "TYPE_FP32"
    assert doc["input"][0]["format"] == "FORMAT_NCHW"
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert doc["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert doc["version_policy"]["specific"]["versions"] == [1, 3]
    assert doc["model_warmup"][0]["inputs"]["x"]["dims"] == [3, 8]
    assert doc["instance_group"] == [] and doc["backend"] == ""  # defaults are printed
