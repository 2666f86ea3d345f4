"""ModelInferRequest -> InferRequest and InferResponse -> ModelInferResponse, with Triton's wire rules.

- `raw_input_contents[k]` is the k-th input that is *not* in shared memory (Triton's separate index).
- `contents` (typed fields) is accepted when the request carries no raw data; both -> INVALID_ARG.
- Tensor bytes are decoded as numpy views (`datatypes.from_buffer`), never copied here.
- The response carries one raw entry per output, empty for outputs written into shared memory;
  `InferOutputTensor.contents` is never set (tritonclient reads only the raw entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2

from edgeserve.frontends.grpc import wire
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, invalid_arg
from edgeserve.protocol.inference import (
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    ParamValue,
    RequestedOutput,
    ShmRef,
    clamp_timeout_us,
)

INT64_MAX = 2**63 - 1

# InferTensorContents field per datatype; FP16 and BF16 have none (raw only).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_CONTENTS_FIELDS = tuple(sorted(set(CONTENTS_FIELD.values())))

_SEQUENCE_FLAGS = ("sequence_start", "sequence_end")
_CUSTOM_KINDS = ("bool_param", "int64_param", "string_param", "double_param")


def _param(p: service_pb2.InferParameter) -> tuple[str | None, Any]:
    kind = p.WhichOneof("parameter_choice")
    return kind, (getattr(p, kind) if kind else None)


def set_param(target: service_pb2.InferParameter, value: ParamValue) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if value > INT64_MAX:
            target.uint64_param = value
        else:
            target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


# -- request ---------------------------------------------------------------------------------------
def request_parameters(params: Mapping[str, service_pb2.InferParameter], request: InferRequest) -> None:
    """Triton's reserved request keys (infer_handler.cc) and the custom ones."""
    for key, p in params.items():
        kind, value = _param(p)
        if key == "sequence_id":
            if kind not in ("int64_param", "string_param"):
                raise invalid_arg(
                    "invalid value type for 'sequence_id' parameter, expected int64_param or string_param"
                )
            request.parameters[key] = value
        elif key in _SEQUENCE_FLAGS:
            if kind != "bool_param":
                raise invalid_arg(f"invalid value type for '{key}' parameter, expected bool_param")
            request.parameters[key] = value
        elif key == "priority":
            if kind not in ("int64_param", "uint64_param") or value < 0:
                raise invalid_arg(
                    "invalid value for 'priority' parameter, expected a non-negative int64_param "
                    "or uint64_param"
                )
            request.priority = int(value)
        elif key == "timeout":
            if kind != "int64_param" or value < 0:
                raise invalid_arg(
                    "invalid value for 'timeout' parameter, expected a non-negative int64_param "
                    "(microseconds)"
                )
            request.timeout_us = clamp_timeout_us(value)
        elif key == "triton_enable_empty_final_response":
            if kind != "bool_param":
                raise invalid_arg(f"invalid value type for '{key}' parameter, expected bool_param")
            request.parameters[key] = value
        elif key.startswith("triton_"):
            raise invalid_arg(
                f"parameter keys starting with 'triton_' are reserved for Triton usage and "
                f"should not be specified: '{key}'"
            )
        else:
            if kind not in _CUSTOM_KINDS:
                raise invalid_arg(
                    f"unsupported type for parameter '{key}': {kind or 'unset'}; custom parameters "
                    "may be bool, int64, string or double"
                )
            request.parameters[key] = value


def tensor_parameters(
    params: Mapping[str, service_pb2.InferParameter], what: str, output: bool
) -> tuple[dict[str, ParamValue], ShmRef | None, int]:
    """(custom parameters, shared-memory reference, classification count) of one tensor."""
    custom: dict[str, ParamValue] = {}
    region: str | None = None
    byte_size: int | None = None
    offset: int | None = None
    classification = 0
    for key, p in params.items():
        kind, value = _param(p)
        if key == "shared_memory_region":
            if kind != "string_param":
                raise invalid_arg(
                    f"{what}: invalid value type for 'shared_memory_region', expected string_param"
                )
            region = value
        elif key in ("shared_memory_byte_size", "shared_memory_offset"):
            if kind != "int64_param":
                raise invalid_arg(f"{what}: invalid value type for '{key}', expected int64_param")
            if value < 0:
                raise invalid_arg(f"{what}: '{key}' must not be negative, got {value}")
            if key == "shared_memory_byte_size":
                byte_size = value
            else:
                offset = value
        elif key == "classification" and output:
            if kind != "int64_param" or value < 0:
                raise invalid_arg(
                    f"{what}: invalid value for 'classification', expected a non-negative int64_param"
                )
            classification = int(value)
        elif kind is not None:
            custom[key] = value
    shm: ShmRef | None = None
    if region is None:
        if byte_size is not None or offset is not None:
            raise invalid_arg(
                f"{what}: 'shared_memory_byte_size' and 'shared_memory_offset' need 'shared_memory_region'"
            )
    else:
        if byte_size is None:
            raise invalid_arg(f"{what}: 'shared_memory_region' needs 'shared_memory_byte_size'")
        shm = ShmRef(region, byte_size, offset or 0)
        if classification:
            raise invalid_arg(f"{what}: classification cannot be returned in shared memory")
    return custom, shm, classification


def _shape(dims: Any, what: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in dims)
    for dim in shape:
        if dim < 0:
            raise invalid_arg(f"{what}: shape {list(shape)} has a negative dimension")
    return shape


def decode_raw(buffer: wire.Buffer, datatype: str, shape: tuple[int, ...], what: str) -> npt.NDArray[Any]:
    if datatype == "BYTES":
        count = datatypes.element_count(shape)
        nbytes = memoryview(buffer).nbytes
        if count * 4 > nbytes:  # every element has a 4-byte length: refuse before allocating
            raise invalid_arg(
                f"{what}: {nbytes} bytes cannot hold {count} BYTES elements of shape {list(shape)}"
            )
    return datatypes.from_buffer(buffer, datatype, shape, what)


def decode_contents(
    contents: service_pb2.InferTensorContents | None, datatype: str, shape: tuple[int, ...], what: str
) -> npt.NDArray[Any]:
    count = datatypes.element_count(shape)
    field = CONTENTS_FIELD.get(datatype)
    populated = [f for f in _ALL_CONTENTS_FIELDS if contents is not None and len(getattr(contents, f))]
    if field is None:  # FP16 / BF16
        if populated or count:
            raise invalid_arg(f"{what}: {datatype} data can only be sent in raw_input_contents")
        return np.empty(shape, dtype=datatypes.numpy_dtype(datatype))
    if any(f != field for f in populated):
        raise invalid_arg(f"{what}: {datatype} data must be in contents.{field}, got {', '.join(populated)}")
    values = list(getattr(contents, field)) if contents is not None else []
    if len(values) != count:
        if not values and not populated:
            raise invalid_arg(
                f"{what} has no data: send raw_input_contents, contents or a shared memory region"
            )
        raise invalid_arg(
            f"{what}: expected {count} elements in contents.{field} for shape {list(shape)}, "
            f"got {len(values)}"
        )
    dtype = datatypes.numpy_dtype(datatype)
    if datatype == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = values
        return array.reshape(shape)
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise invalid_arg(f"{what}: contents.{field} values do not fit {datatype}: {exc}") from None


def to_infer_request(decoded: wire.DecodedInfer) -> InferRequest:
    msg = decoded.message
    request = InferRequest(model_name=msg.model_name, model_version=msg.model_version, id=msg.id)
    if msg.parameters:
        request_parameters(msg.parameters, request)
    raw = decoded.raw
    raw_index = 0
    for tensor in msg.inputs:
        name = tensor.name
        what = f"input '{name}'"
        datatype = tensor.datatype
        if not datatypes.is_known(datatype):
            raise invalid_arg(f"{what}: unknown datatype '{datatype}'")
        shape = _shape(tensor.shape, what)
        params, shm, _ = (
            tensor_parameters(tensor.parameters, what, output=False) if tensor.parameters else ({}, None, 0)
        )
        has_contents = tensor.HasField("contents")
        if shm is not None:
            if has_contents:
                raise invalid_arg(f"{what}: shared memory and contents cannot both be given")
            request.inputs.append(InputTensor(name, datatype, shape, None, shm, params))
            continue
        if raw:
            if has_contents:
                raise invalid_arg(f"{what}: contents must not be specified when using raw_input_contents")
            if raw_index >= len(raw):
                raise invalid_arg(
                    f"{what} has no data: got {len(raw)} raw_input_contents for more inputs "
                    "outside shared memory"
                )
            data = decode_raw(raw[raw_index], datatype, shape, what)
            raw_index += 1
        else:
            data = decode_contents(tensor.contents if has_contents else None, datatype, shape, what)
        request.inputs.append(InputTensor(name, datatype, shape, data, None, params))
    if raw_index != len(raw):
        raise invalid_arg(f"got {len(raw)} raw_input_contents but {raw_index} inputs outside shared memory")
    if msg.outputs:
        outputs: list[RequestedOutput] = []
        for out in msg.outputs:
            if not out.parameters:  # the usual case: a name only
                outputs.append(RequestedOutput(out.name, None, 0, None, {}))
                continue
            params, shm, classification = tensor_parameters(out.parameters, f"output '{out.name}'", True)
            outputs.append(RequestedOutput(out.name, shm, classification, None, params))
        request.outputs = outputs
    return request


# -- response --------------------------------------------------------------------------------------
def output_buffer(out: OutputTensor) -> wire.Buffer:
    """Raw wire bytes of one output: a zero-copy view for contiguous arrays, b"" for shm outputs."""
    if out.data is None:
        return b""
    if out.datatype == "BYTES":
        return datatypes.serialize_bytes(np.asarray(out.data))
    array = np.ascontiguousarray(out.data)
    # via uint8: memoryview() cannot export ml_dtypes' bfloat16
    return array.reshape(-1).view(np.uint8).data


# Serialized response headers (the message without raw outputs) of plain responses: no id, no
# parameters. A model answers with the same few headers, and building one is a third of encoding.
_HEADERS: dict[tuple[Any, ...], bytes] = {}
_HEADERS_MAX = 512


def _response_header(response: InferResponse, final: bool | None) -> bytes:
    if response.id or response.parameters:
        return _build_header(response, final)
    key: list[Any] = [response.model_name, response.model_version, final]
    for out in response.outputs:
        if out.parameters:
            return _build_header(response, final)
        key += (out.name, out.datatype, out.shape)
    cache_key = tuple(key)
    try:
        header = _HEADERS.get(cache_key)
    except TypeError:  # a shape given as a list
        return _build_header(response, final)
    if header is None:
        if len(_HEADERS) >= _HEADERS_MAX:  # many shapes (dynamic dims): start over, stay bounded
            _HEADERS.clear()
        header = _HEADERS[cache_key] = _build_header(response, final)
    return header


def _build_header(response: InferResponse, final: bool | None) -> bytes:
    msg = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for key, value in response.parameters.items():
        set_param(msg.parameters[key], value)
    if final is not None:
        msg.parameters["triton_final_response"].bool_param = final
    for out in response.outputs:
        tensor = msg.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        for key, value in out.parameters.items():
            set_param(tensor.parameters[key], value)
    return bytes(msg.SerializeToString())


def response_parts(
    response: InferResponse, final: bool | None = None, limit: int = 2**31 - 1
) -> tuple[list[wire.Buffer], int]:
    """Wire parts of the ModelInferResponse and their size; `final` adds `triton_final_response`."""
    buffers = [output_buffer(out) for out in response.outputs]
    parts, size = wire.infer_response_bytes(_response_header(response, final), buffers)
    if size > limit:
        raise invalid_arg(f"response has byte size {size} which exceeds gRPC's byte size limit {limit}")
    return parts, size


def encode_response(response: InferResponse, limit: int = 2**31 - 1) -> bytes:
    parts, _ = response_parts(response, None, limit)
    return wire.join(parts)


def encode_stream_response(response: InferResponse, limit: int = 2**31 - 1, final: bool = True) -> bytes:
    parts, size = response_parts(response, final, limit)
    return wire.join(wire.wrap_stream_response(parts, size))


def encode_stream_error(
    error: InferenceError | str, request_id: str = "", model_name: str = "", model_version: str = "",
    final: bool = True,
) -> bytes:  # fmt: skip
    message = error.message if isinstance(error, InferenceError) else error
    msg = service_pb2.ModelStreamInferResponse(error_message=message)
    inner = msg.infer_response
    inner.id = request_id
    inner.model_name = model_name
    inner.model_version = model_version
    inner.parameters["triton_final_response"].bool_param = final
    return bytes(msg.SerializeToString())
