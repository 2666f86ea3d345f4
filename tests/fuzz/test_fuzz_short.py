"""The short seeded fuzz run (CI) and property tests of the codecs: any input decodes or raises our
InferenceError with a client-error status, never another exception. The long run is
`python tests/fuzz/run_fuzz.py --seconds 1800 --seed N` (docs/robustness.md, "Garbage gets a 4xx")."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2, service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from fuzz_engine import Options, run

from edgeserve.frontends.grpc import codec as grpc_codec
from edgeserve.frontends.grpc import wire as grpc_wire
from edgeserve.frontends.http import codec as http_codec
from edgeserve.frontends.http.jsontensor import json_to_array
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.zmq import codec as zmq_codec
from edgeserve.frontends.zmq import replies as zmq_replies
from edgeserve.frontends.zmq import wire as zmq_wire
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import MAX_TIMEOUT_US, InferRequest, RequestedOutput
from edgeserve.server import validation

CLIENT_ERRORS = {Status.INVALID_ARG, Status.NOT_FOUND}
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_short_seeded_fuzz_run(tmp_path: Path) -> None:
    """Every frontend, about 40 s: no 5xx / INTERNAL / UNKNOWN, no hang, no crash, checks pass."""
    report = run(Options(seconds=40, seed=20240613, batch=40, timeout=10.0), tmp_path)
    assert report["ok"], json.dumps(report, indent=2)[:6000]
    assert all(report["requests"].get(f, 0) > 0 for f in report["frontends"]), report["requests"]


def client_error(call: Any) -> None:
    """`call()` either returns or raises InferenceError with a client-error status."""
    try:
        call()
    except InferenceError as exc:
        assert exc.status in CLIENT_ERRORS, exc
        assert exc.http_status < 500


# -- JSON values -----------------------------------------------------------------------------------
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
dims = st.lists(
    st.one_of(st.integers(min_value=-3, max_value=5), st.sampled_from([2**40, 2**41, 2**63 - 1, 2**64])),
    max_size=70,
)
datatype = st.sampled_from([*datatypes.DATATYPES, "BF16", "STRING", ""])


@PROPERTY
@given(data=json_value, dt=datatype, shape=dims)
def test_json_tensor_decode_never_fails_otherwise(data: Any, dt: str, shape: list[int]) -> None:
    if not datatypes.is_known(dt) or any(d < 0 for d in shape):
        return  # the request decoder refuses these before json_to_array
    client_error(lambda: json_to_array(data, dt, tuple(shape), "input 'x'"))


@PROPERTY
@given(
    entry=st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["INPUT0", "", 3]),
            "datatype": datatype | json_value,
            "shape": dims | json_value,
            "data": json_value,
            "parameters": st.dictionaries(
                st.sampled_from(
                    [
                        "binary_data_size",
                        "shared_memory_region",
                        "shared_memory_byte_size",
                        "shared_memory_offset",
                        "x",
                    ]
                ),
                json_value,
                max_size=3,
            )
            | json_value,
        },
    ),
    params=st.dictionaries(
        st.sampled_from(
            ["timeout", "priority", "sequence_id", "sequence_start", "binary_data_output", "triton_x", "y"]
        ),
        json_value,
        max_size=3,
    ),
    tail=st.binary(max_size=40),
    lie=st.integers(min_value=-5, max_value=50),
)
def test_http_request_decode_never_fails_otherwise(
    entry: dict[str, Any], params: dict[str, Any], tail: bytes, lie: int
) -> None:
    head = json.dumps({"inputs": [entry], "parameters": params}).encode()
    body = head + tail

    def decode() -> None:
        length = http_codec.parse_header_length(str(len(head) + lie) if tail else None, len(body))
        http_codec.decode_request("m", "", body, length)

    client_error(decode)


@PROPERTY
@given(body=st.binary(max_size=200), header=st.text(max_size=12))
def test_http_binary_bytes_never_fail_otherwise(body: bytes, header: str) -> None:
    def decode() -> None:
        length = http_codec.parse_header_length(header, len(body))
        if length != 0:
            http_codec.decode_request("m", "", body, length)

    client_error(decode)


@PROPERTY
@given(
    body=st.binary(max_size=64),
    dt=st.sampled_from(["FP32", "BYTES", "UINT8", "FP16"]),
    config_dims=st.lists(st.sampled_from([-1, 1, 2, 4]), max_size=3),
    batch=st.sampled_from([0, 4]),
)
def test_http_raw_binary_never_fails_otherwise(
    body: bytes, dt: str, config_dims: list[int], batch: int
) -> None:
    config = model_config_pb2.ModelConfig(name="m", max_batch_size=batch)
    config.input.add(
        name="x",
        data_type=model_config_pb2.DataType.Value(datatypes.protocol_to_config(dt)),
        dims=config_dims,
    )
    client_error(lambda: http_codec.decode_raw_request("m", "", body, config))


# -- gRPC ------------------------------------------------------------------------------------------
@PROPERTY
@given(
    dt=datatype,
    shape=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=70),
    raw=st.lists(st.binary(max_size=64), max_size=3),
    contents=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
    timeout=st.integers(0, 2**63 - 1),
)
def test_grpc_request_decode_never_fails_otherwise(
    dt: str, shape: list[int], raw: list[bytes], contents: list[int], timeout: int
) -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    tensor = msg.inputs.add(name="x", datatype=dt, shape=shape)
    tensor.contents.int_contents.extend(contents)
    msg.raw_input_contents.extend(raw)
    msg.parameters["timeout"].int64_param = timeout
    decoded = grpc_wire.deserialize_infer_request(msg.SerializeToString())
    assert isinstance(decoded, grpc_wire.DecodedInfer)

    def decode() -> None:
        request = grpc_codec.to_infer_request(decoded)
        assert request.timeout_us <= MAX_TIMEOUT_US

    client_error(decode)


@PROPERTY
@given(data=st.binary(max_size=300))
def test_grpc_wire_never_raises(data: bytes) -> None:
    assert isinstance(
        grpc_wire.deserialize_infer_request(data), (grpc_wire.DecodedInfer, grpc_wire.Malformed)
    )
    big = data + b"\x3a\x80\x80\x04" + b"\0" * 70000  # the scanning path (above SCAN_THRESHOLD)
    assert isinstance(grpc_wire.deserialize_infer_request(big), (grpc_wire.DecodedInfer, grpc_wire.Malformed))


# -- ZeroMQ ----------------------------------------------------------------------------------------
@PROPERTY
@given(
    header=st.fixed_dictionaries(
        {"model": st.sampled_from(["m", "", 5])},
        optional={
            "inputs": st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["x", 1])},
                    optional={
                        "datatype": datatype | json_value,
                        "shape": dims | json_value,
                        "parameters": json_value,
                        "shm": json_value,
                    },
                ),
                max_size=3,
            )
            | json_value,
            "outputs": st.lists(
                st.fixed_dictionaries(
                    {"name": st.just("y")}, optional={"classification": json_value, "shm": json_value}
                ),
                max_size=2,
            )
            | json_value,
            "priority": json_value,
            "timeout_us": json_value,
            "version": json_value,
            "parameters": json_value,
        },
    ),
    frames=st.lists(st.binary(max_size=40), max_size=3),
)
def test_zmq_decode_never_fails_otherwise(header: dict[str, Any], frames: list[bytes]) -> None:
    registry = SharedMemoryRegistry()

    def decode() -> None:
        decoded = zmq_codec.decode_infer(header, frames, registry)
        assert 0 <= decoded.request.timeout_us <= MAX_TIMEOUT_US
        decoded.release()

    client_error(decode)


@PROPERTY
@given(data=st.binary(max_size=100) | st.just(b"[" * 100000))
def test_zmq_header_loads_raises_only_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        zmq_wire.loads(data)


def test_zmq_reply_with_a_lone_surrogate_is_sent() -> None:
    """A client's id "\\ud800" echoed in a reply: was UnicodeEncodeError (no reply, the client hung)."""
    frames = zmq_replies.error_reply("\ud800", InferenceError(Status.INVALID_ARG, "bad '\udfff'"))
    assert json.loads(frames[0])["id"] == "\ud800"


# -- regressions found by the fuzzer ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1,) * 65, (0, 2**40 + 1, 2**40), (2**62, 0), (0, 2**63 - 1)])
def test_shapes_numpy_refuses_are_invalid_arg(shape: tuple[int, ...]) -> None:
    """Were 500s: more than 64 dims (numpy's limit) and empty shapes whose other dims overflow numpy."""
    with pytest.raises(InferenceError) as info:
        datatypes.from_buffer(b"", "FP32", shape, "input 'x'")
    assert info.value.status == Status.INVALID_ARG
    with pytest.raises(InferenceError):
        json_to_array([] if 0 in shape else [1], "FP32", shape, "input 'x'")


def test_grpc_shape_negative_and_huge_are_invalid_arg() -> None:
    for shape in ([-1, 16], [1, 2**40 + 1], [0, 2**62, 2**62], [1] * 65):
        msg = service_pb2.ModelInferRequest(model_name="m")
        msg.inputs.add(name="x", datatype="FP32", shape=shape)
        msg.raw_input_contents.append(b"")
        decoded = grpc_wire.deserialize_infer_request(msg.SerializeToString())
        assert isinstance(decoded, grpc_wire.DecodedInfer)
        with pytest.raises(InferenceError) as info:
            grpc_codec.to_infer_request(decoded)
        assert info.value.status == Status.INVALID_ARG, shape


def test_json_bytes_with_a_lone_surrogate_is_invalid_arg() -> None:
    with pytest.raises(InferenceError) as info:
        json_to_array(["\ud800"], "BYTES", (1,), "input 'x'")
    assert info.value.status == Status.INVALID_ARG and "surrogate" in info.value.message


def test_huge_request_timeouts_are_clamped() -> None:
    """Was a dead scheduler worker (OverflowError in a wait): a timeout of 2^63-1 us from the client."""
    head = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "parameters": {"timeout": 2**63 - 1},
        }
    ).encode()
    request, _ = http_codec.decode_request("m", "", head, None)
    assert request.timeout_us == MAX_TIMEOUT_US
    decoded = zmq_codec.decode_infer(
        {"model": "m", "inputs": [], "timeout_us": 2**64}, [], SharedMemoryRegistry()
    )
    assert decoded.request.timeout_us == MAX_TIMEOUT_US
    with pytest.raises(InferenceError):
        zmq_codec.decode_infer({"model": "m", "inputs": [], "timeout_us": -1}, [], SharedMemoryRegistry())


def test_classification_of_a_bytes_output_is_invalid_arg() -> None:
    """Was a 500 ("could not convert string to float") when the response was built."""
    config = model_config_pb2.ModelConfig(name="m", max_batch_size=8)
    config.output.add(name="y", data_type=model_config_pb2.TYPE_STRING, dims=[-1])
    request = InferRequest("m", outputs=[RequestedOutput("y", classification=2)])
    with pytest.raises(InferenceError) as info:
        validation.requested_output_names(request, config, "m")
    assert info.value.status == Status.INVALID_ARG and "BYTES" in info.value.message


def test_bytes_length_prefix_lie_is_invalid_arg() -> None:
    blob = struct.pack("<I", 2**32 - 1) + b"ab"
    with pytest.raises(InferenceError):
        datatypes.from_buffer(blob, "BYTES", (1,), "input 'x'")
    assert np.asarray(datatypes.from_buffer(struct.pack("<I", 2) + b"ab", "BYTES", (1,), "x"))[0] == b"ab"
