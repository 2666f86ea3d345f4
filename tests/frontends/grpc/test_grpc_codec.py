"""Unit tests of the gRPC wire helpers and codec: no server, the real generated messages."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from edgeserve.frontends.grpc import codec, wire
from edgeserve.protocol.datatypes import FIXED_SIZE_DATATYPES
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferResponse, OutputTensor, ShmRef


def make_request(inputs: list[tuple[str, str, list[int], bytes | None]], **kwargs: object) -> bytes:
    msg = service_pb2.ModelInferRequest(model_name="m", id="r1", **kwargs)
    for name, datatype, shape, data in inputs:
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        if data is not None:
            msg.raw_input_contents.append(data)
    return bytes(msg.SerializeToString())


def decode(data: bytes) -> wire.DecodedInfer:
    decoded = wire.deserialize_infer_request(data)
    assert isinstance(decoded, wire.DecodedInfer), decoded
    return decoded


# -- wire ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**31 - 1, 2**63])
def test_varint_round_trip(value: int) -> None:
    encoded = wire.encode_varint(value)
    assert wire.read_varint(memoryview(encoded), 0, len(encoded)) == (value, len(encoded))


def test_large_request_is_split_without_copies() -> None:
    frame = np.random.default_rng(0).integers(0, 255, (1, 480, 640, 3), dtype=np.uint8)
    extra = np.arange(10, dtype=np.float32)
    data = make_request(
        [("images", "UINT8", list(frame.shape), frame.tobytes()), ("x", "FP32", [10], extra.tobytes())],
        model_version="2",
    )
    assert len(data) > wire.SCAN_THRESHOLD
    decoded = decode(data)
    assert decoded.message.model_name == "m" and decoded.message.model_version == "2"
    assert len(decoded.message.raw_input_contents) == 0  # tensor bytes never entered protobuf
    assert [bytes(b) for b in decoded.raw] == [frame.tobytes(), extra.tobytes()]
    request = codec.to_infer_request(decoded)
    images = request.inputs[0].data
    assert images is not None and np.array_equal(images, frame)
    assert np.shares_memory(images, np.frombuffer(data, np.uint8))  # a view into the received bytes


def test_scan_and_stock_parser_agree_on_field_order() -> None:
    # raw_input_contents before the inputs, and an unknown field: the remainder must still parse
    big = b"\x01" * (wire.SCAN_THRESHOLD + 10)
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="a", datatype="UINT8", shape=[len(big)])
    head = service_pb2.ModelInferRequest(raw_input_contents=[big]).SerializeToString()
    unknown = wire.encode_varint((99 << 3) | 0) + wire.encode_varint(5)
    data = head + msg.SerializeToString() + unknown
    decoded = decode(data)
    assert decoded.message.inputs[0].name == "a"
    assert bytes(decoded.raw[0]) == big


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\xff",  # length past the end
        b"\x0a",  # truncated length
        b"\x00\x01",  # field number 0
        b"\x3a" + wire.encode_varint(10**9),  # raw entry longer than the message
        b"\xff" * 12,  # endless varint
        b"\x0a\x02\xc3\x28",  # model_name that is not UTF-8
    ],
)
def test_malformed_requests_are_reported_not_raised(data: bytes) -> None:
    small = wire.deserialize_infer_request(data)
    padded = wire.deserialize_infer_request(data + b"\x00" * 0)  # same bytes, small path
    assert isinstance(small, wire.Malformed) and isinstance(padded, wire.Malformed)
    # and through the scanning path (messages above the threshold)
    big = b"\x3a" + wire.encode_varint(wire.SCAN_THRESHOLD) + b"\x00" * wire.SCAN_THRESHOLD + data
    assert isinstance(wire.deserialize_infer_request(big), wire.Malformed)
    assert small.message.startswith("Unable to parse request")


def test_safe_deserializer() -> None:
    parse = wire.safe_deserializer(service_pb2.ModelReadyRequest)
    assert parse(service_pb2.ModelReadyRequest(name="x").SerializeToString()).name == "x"
    assert isinstance(parse(b"\x0a\x05ab"), wire.Malformed)


# -- request decoding --------------------------------------------------------------------------------
def test_raw_index_skips_shared_memory_inputs() -> None:
    a = np.arange(4, dtype=np.int32)
    msg = service_pb2.ModelInferRequest(model_name="m")
    shm_in = msg.inputs.add(name="IN_SHM", datatype="INT32", shape=[4])
    shm_in.parameters["shared_memory_region"].string_param = "r0"
    shm_in.parameters["shared_memory_byte_size"].int64_param = 16
    shm_in.parameters["shared_memory_offset"].int64_param = 32
    msg.inputs.add(name="IN_RAW", datatype="INT32", shape=[4])
    msg.raw_input_contents.append(a.tobytes())
    out = msg.outputs.add(name="OUT")
    out.parameters["shared_memory_region"].string_param = "r1"
    out.parameters["shared_memory_byte_size"].int64_param = 64
    request = codec.to_infer_request(decode(msg.SerializeToString()))
    assert request.inputs[0].shm == ShmRef("r0", 16, 32) and request.inputs[0].data is None
    assert np.array_equal(request.inputs[1].data, a)  # type: ignore[arg-type]
    assert request.outputs is not None and request.outputs[0].shm == ShmRef("r1", 64, 0)


def test_no_outputs_means_all_outputs() -> None:
    request = codec.to_infer_request(
        decode(make_request([("a", "FP32", [1], np.zeros(1, np.float32).tobytes())]))
    )
    assert request.outputs is None and request.id == "r1" and request.model_name == "m"


@pytest.mark.parametrize(
    "datatype",
    list(FIXED_SIZE_DATATYPES),
)
def test_raw_decoding_per_datatype(datatype: str) -> None:
    from edgeserve.protocol import datatypes

    dtype = datatypes.numpy_dtype(datatype)
    array = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    request = codec.to_infer_request(decode(make_request([("a", datatype, [2, 3], array.tobytes())])))
    data = request.inputs[0].data
    assert data is not None and data.dtype == dtype and np.array_equal(data, array)


def test_bytes_raw_decoding() -> None:
    values = np.array([b"abc", b"", "ünï".encode()], dtype=np.object_)
    payload = serialize_byte_tensor(values).item()
    request = codec.to_infer_request(decode(make_request([("s", "BYTES", [3], payload)])))
    assert list(request.inputs[0].data) == list(values)  # type: ignore[arg-type]


def test_typed_contents_are_accepted_without_raw() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="i", datatype="INT16", shape=[2, 2])
    t.contents.int_contents.extend([1, -2, 3, 4])
    s = msg.inputs.add(name="s", datatype="BYTES", shape=[2])
    s.contents.bytes_contents.extend([b"x", b"yz"])
    b = msg.inputs.add(name="b", datatype="BOOL", shape=[1])
    b.contents.bool_contents.append(True)
    request = codec.to_infer_request(decode(msg.SerializeToString()))
    assert request.inputs[0].data.dtype == np.int16  # type: ignore[union-attr]
    assert request.inputs[0].data.tolist() == [[1, -2], [3, 4]]  # type: ignore[union-attr]
    assert list(request.inputs[1].data) == [b"x", b"yz"]  # type: ignore[arg-type]
    assert request.inputs[2].data.tolist() == [True]  # type: ignore[union-attr]


def _error(fn: object, *args: object) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


def test_contents_errors() -> None:
    both = service_pb2.ModelInferRequest(model_name="m")
    t = both.inputs.add(name="a", datatype="INT32", shape=[1])
    t.contents.int_contents.append(1)
    both.inputs.add(name="b", datatype="INT32", shape=[1])
    both.raw_input_contents.append(b"\0\0\0\0")
    assert "contents" in _error(codec.to_infer_request, decode(both.SerializeToString())).message

    fp16 = service_pb2.ModelInferRequest(model_name="m")
    fp16.inputs.add(name="h", datatype="FP16", shape=[1]).contents.fp32_contents.append(1.0)
    assert "raw" in _error(codec.to_infer_request, decode(fp16.SerializeToString())).message

    wrong_field = service_pb2.ModelInferRequest(model_name="m")
    wrong_field.inputs.add(name="i", datatype="INT32", shape=[1]).contents.fp32_contents.append(1.0)
    assert "int_contents" in _error(codec.to_infer_request, decode(wrong_field.SerializeToString())).message

    overflow = service_pb2.ModelInferRequest(model_name="m")
    overflow.inputs.add(name="i", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    assert _error(codec.to_infer_request, decode(overflow.SerializeToString())).status is Status.INVALID_ARG

    empty = service_pb2.ModelInferRequest(model_name="m")
    empty.inputs.add(name="i", datatype="INT32", shape=[2])
    assert "no data" in _error(codec.to_infer_request, decode(empty.SerializeToString())).message


@pytest.mark.parametrize(
    ("inputs", "words"),
    [
        ([("a", "FP32", [4], b"\0" * 15)], "expected 16"),  # wrong size
        ([("a", "FP32", [2**40, 2**20], b"\0" * 16)], "2^40"),  # huge shape: refused, no allocation
        ([("a", "BYTES", [2**40], b"\0" * 16)], "cannot hold"),  # huge BYTES shape: refused before np.empty
        ([("a", "BYTES", [2], b"\5\0\0\0abc")], "BYTES"),  # element past the end
        ([("a", "FP32", [-1], b"")], "negative"),
        ([("a", "FLOAT", [1], b"\0" * 4)], "unknown datatype"),
        ([("a", "FP32", [1], b"\0" * 4), ("b", "FP32", [1], None)], "no data"),  # fewer raw than inputs
    ],
)
def test_bad_tensors_are_invalid_arg(
    inputs: list[tuple[str, str, list[int], bytes | None]], words: str
) -> None:
    error = _error(codec.to_infer_request, decode(make_request(inputs)))
    assert error.status is Status.INVALID_ARG and words in error.message, error.message


def test_extra_raw_contents_are_invalid_arg() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 4, b"\0" * 4])
    msg.inputs.add(name="a", datatype="FP32", shape=[1])
    assert "2 raw_input_contents" in _error(codec.to_infer_request, decode(msg.SerializeToString())).message


def _with_params(**params: service_pb2.InferParameter) -> wire.DecodedInfer:
    msg = service_pb2.ModelInferRequest(model_name="m")
    for key, value in params.items():
        msg.parameters[key].CopyFrom(value)
    return decode(msg.SerializeToString())


P = service_pb2.InferParameter


def test_request_parameters() -> None:
    request = codec.to_infer_request(
        _with_params(
            priority=P(uint64_param=2),
            timeout=P(int64_param=5000),
            sequence_id=P(string_param="cam1"),
            sequence_start=P(bool_param=True),
            sequence_end=P(bool_param=False),
            triton_enable_empty_final_response=P(bool_param=True),
            tag=P(string_param="x"),
            score=P(double_param=0.5),
        )
    )
    assert request.priority == 2 and request.timeout_us == 5000
    assert request.parameters["sequence_id"] == "cam1" and request.parameters["sequence_start"] is True
    assert request.parameters["tag"] == "x" and request.parameters["score"] == 0.5
    assert codec.to_infer_request(_with_params(priority=P(int64_param=1))).priority == 1
    assert codec.to_infer_request(_with_params(sequence_id=P(int64_param=7))).parameters["sequence_id"] == 7


@pytest.mark.parametrize(
    "params",
    [
        {"priority": P(int64_param=-1)},
        {"priority": P(string_param="high")},
        {"timeout": P(uint64_param=5)},
        {"sequence_start": P(int64_param=1)},
        {"sequence_id": P(bool_param=True)},
        {"triton_something": P(bool_param=True)},
        {"custom": P(uint64_param=1)},
        {"custom": P()},
    ],
)
def test_bad_request_parameters(params: dict[str, service_pb2.InferParameter]) -> None:
    assert _error(codec.to_infer_request, _with_params(**params)).status is Status.INVALID_ARG


@pytest.mark.parametrize(
    "params",
    [
        {"shared_memory_byte_size": P(int64_param=4)},  # no region
        {"shared_memory_offset": P(int64_param=4)},
        {"shared_memory_region": P(string_param="r")},  # no byte size
        {"shared_memory_region": P(int64_param=1), "shared_memory_byte_size": P(int64_param=4)},
        {"shared_memory_region": P(string_param="r"), "shared_memory_byte_size": P(int64_param=-4)},
        {"shared_memory_region": P(string_param="r"), "shared_memory_byte_size": P(uint64_param=4)},
    ],
)
def test_bad_shared_memory_parameters(params: dict[str, service_pb2.InferParameter]) -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="a", datatype="FP32", shape=[1])
    for key, value in params.items():
        t.parameters[key].CopyFrom(value)
    assert _error(codec.to_infer_request, decode(msg.SerializeToString())).status is Status.INVALID_ARG


def test_classification_and_shm_output_conflict() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    out = msg.outputs.add(name="o")
    out.parameters["classification"].int64_param = 3
    assert codec.to_infer_request(decode(msg.SerializeToString())).outputs[0].classification == 3  # type: ignore[index]
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 64
    assert "classification" in _error(codec.to_infer_request, decode(msg.SerializeToString())).message


# -- response encoding -------------------------------------------------------------------------------
def _response() -> InferResponse:
    import ml_dtypes

    return InferResponse(
        model_name="m",
        model_version="3",
        id="r9",
        outputs=[
            OutputTensor("f", "FP32", (2, 2), np.arange(4, dtype=np.float32).reshape(2, 2)),
            # not contiguous:
            OutputTensor("t", "FP32", (2, 2), np.arange(4, dtype=np.float32).reshape(2, 2).T),
            OutputTensor("s", "BYTES", (2,), np.array([b"ab", b""], dtype=np.object_)),
            OutputTensor("shm", "INT32", (4,), None, shm=ShmRef("r", 16)),
            OutputTensor("bf", "BF16", (2,), np.array([1.0, -2.0], dtype=ml_dtypes.bfloat16)),
        ],
        parameters={"flag": True, "n": 3, "x": 0.25, "s": "v"},
    )


def _check_infer_response(msg: service_pb2.ModelInferResponse) -> None:
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "3", "r9")
    assert [o.name for o in msg.outputs] == ["f", "t", "s", "shm", "bf"]
    assert len(msg.raw_output_contents) == 5  # one entry per output, shm included (empty)
    assert np.frombuffer(msg.raw_output_contents[0], np.float32).tolist() == [0, 1, 2, 3]
    assert np.frombuffer(msg.raw_output_contents[1], np.float32).tolist() == [0, 2, 1, 3]
    assert msg.raw_output_contents[2] == b"\2\0\0\0ab\0\0\0\0"
    assert msg.raw_output_contents[3] == b""
    assert msg.raw_output_contents[4] == np.array([1.0, -2.0], np.float32).view(np.uint16)[1::2].tobytes()
    assert list(msg.outputs[0].shape) == [2, 2] and msg.outputs[2].datatype == "BYTES"
    assert not msg.outputs[0].HasField("contents")
    assert msg.parameters["flag"].bool_param is True and msg.parameters["n"].int64_param == 3
    assert msg.parameters["x"].double_param == 0.25 and msg.parameters["s"].string_param == "v"


def test_encode_response_parses_with_the_stock_classes() -> None:
    msg = service_pb2.ModelInferResponse.FromString(codec.encode_response(_response()))
    _check_infer_response(msg)
    assert "triton_final_response" not in msg.parameters
    from tritonclient.grpc import InferResult

    result = InferResult(msg)
    assert result.as_numpy("f").tolist() == [[0, 1], [2, 3]]
    assert result.as_numpy("s").tolist() == [b"ab", b""]
    assert result.as_numpy("bf").astype(np.float32).tolist() == [1.0, -2.0]


def test_encode_stream_response() -> None:
    msg = service_pb2.ModelStreamInferResponse.FromString(codec.encode_stream_response(_response()))
    assert msg.error_message == ""
    _check_infer_response(msg.infer_response)
    assert msg.infer_response.parameters["triton_final_response"].bool_param is True


def test_encode_stream_error() -> None:
    data = codec.encode_stream_error(InferenceError(Status.NOT_FOUND, "no model"), "r1", "m", "")
    msg = service_pb2.ModelStreamInferResponse.FromString(data)
    assert msg.error_message == "no model" and msg.infer_response.id == "r1"
    assert msg.infer_response.parameters["triton_final_response"].bool_param is True


def test_response_size_limit() -> None:
    response = InferResponse("m", "1", "", [OutputTensor("o", "UINT8", (100,), np.zeros(100, np.uint8))])
    error = _error(codec.encode_response, response, 64)
    assert error.status is Status.INVALID_ARG and "exceeds" in error.message


def test_plain_response_headers_are_reused_per_shape_and_stay_bounded() -> None:
    """Responses without id or parameters share a cached header: each must still name its own shape
    and data, unary and stream headers must not mix, and the cache never outgrows its bound."""

    def plain(rows: int, version: str = "1") -> InferResponse:
        data = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
        return InferResponse("m", version, "", [OutputTensor("o", "FP32", (rows, 3), data)])

    for rows in (1, 2, 1, 5, 2):
        msg = service_pb2.ModelInferResponse.FromString(codec.encode_response(plain(rows)))
        assert list(msg.outputs[0].shape) == [rows, 3]
        assert np.frombuffer(msg.raw_output_contents[0], np.float32).tolist() == list(range(rows * 3))
        assert "triton_final_response" not in msg.parameters
        stream = service_pb2.ModelStreamInferResponse.FromString(codec.encode_stream_response(plain(rows)))
        assert stream.infer_response.parameters["triton_final_response"].bool_param is True
        assert list(stream.infer_response.outputs[0].shape) == [rows, 3]
    other = service_pb2.ModelInferResponse.FromString(codec.encode_response(plain(2, version="7")))
    assert other.model_version == "7"
    # an id or parameters are never served from the cache
    with_id = InferResponse("m", "1", "req-1", plain(1).outputs)
    assert service_pb2.ModelInferResponse.FromString(codec.encode_response(with_id)).id == "req-1"
    for rows in range(1, codec._HEADERS_MAX + 50):  # dynamic shapes: bounded
        codec.encode_response(plain(rows))
    assert len(codec._HEADERS) <= codec._HEADERS_MAX
