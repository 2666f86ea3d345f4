"""KServe V2 HTTP tensor codec: JSON tensors and Triton's binary tensor extension.

Decoding turns a request body into an `InferRequest` whose binary inputs are numpy **views** into
the body (no copy); encoding turns an `InferResponse` into a JSON header plus the concatenated
binary outputs. Every malformed request raises `invalid_arg` with a message that says what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.frontends.http.jsontensor import array_to_json, is_int, json_to_array
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import invalid_arg
from edgeserve.protocol.inference import (
    InferRequest,
    InferResponse,
    InputTensor,
    ParamValue,
    RequestedOutput,
    ShmRef,
    clamp_timeout_us,
)

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

HEADER_LENGTH = "Inference-Header-Content-Length"
_SHM_KEYS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


# -- small typed readers -------------------------------------------------------------------------
def json_int(value: Any, what: str, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        raise invalid_arg(f"{what} must be an integer >= {minimum}, got {json.dumps(value)}")
    return int(value)


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise invalid_arg(f"{what} must be true or false, got {json.dumps(value)}")
    return value


def json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid_arg(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _scalar_param(key: str, value: Any, what: str) -> ParamValue:
    if isinstance(value, (bool, int, float, str)):
        return value
    raise invalid_arg(f"{what} parameter '{key}' must be a bool, number or string, got {json.dumps(value)}")


def parse_header_length(value: str | None, body_size: int) -> int | None:
    """The `Inference-Header-Content-Length` header: None when absent, else a checked length."""
    if value is None:
        return None
    try:
        length = int(value.strip())
    except ValueError:
        raise invalid_arg(f"{HEADER_LENGTH} header must be an integer, got '{value}'") from None
    if length < 0 or length > body_size:
        raise invalid_arg(f"{HEADER_LENGTH} header is {length} but the request body has {body_size} bytes")
    return length


def parse_json(buffer: bytes | memoryview, what: str = "request") -> Any:
    try:
        return json.loads(bytes(buffer) if isinstance(buffer, memoryview) else buffer)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_arg(f"failed to parse the {what} JSON buffer: {exc}") from None
    except RecursionError:
        raise invalid_arg(f"failed to parse the {what} JSON buffer: nested too deeply") from None


# -- shared memory ---------------------------------------------------------------------------------
def _shm_ref(params: Mapping[str, Any], what: str) -> ShmRef | None:
    region = params.get("shared_memory_region")
    if region is None:
        if "shared_memory_byte_size" in params or "shared_memory_offset" in params:
            raise invalid_arg(f"{what}: shared_memory_byte_size/offset given without shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise invalid_arg(f"{what}: shared_memory_region must be a non-empty string")
    if "shared_memory_byte_size" not in params:
        raise invalid_arg(f"{what}: shared_memory_region '{region}' needs shared_memory_byte_size")
    size = json_int(params["shared_memory_byte_size"], f"{what}: shared_memory_byte_size")
    offset = json_int(params.get("shared_memory_offset", 0), f"{what}: shared_memory_offset")
    return ShmRef(region, size, offset)


# -- request decoding ------------------------------------------------------------------------------
def _request_parameters(params: dict[str, Any], request: InferRequest) -> bool:
    """Fill priority/timeout/custom parameters; return the `binary_data_output` flag."""
    binary_output = False
    for key, value in params.items():
        if key == "binary_data_output":
            binary_output = _bool(value, "parameter 'binary_data_output'")
        elif key == "priority":
            request.priority = json_int(value, "parameter 'priority'")
        elif key == "timeout":
            request.timeout_us = clamp_timeout_us(json_int(value, "parameter 'timeout' (microseconds)"))
        elif key == "sequence_id":
            if not (is_int(value) and value >= 0) and not isinstance(value, str):
                raise invalid_arg(
                    f"parameter 'sequence_id' must be an unsigned integer or a string, got {value!r}"
                )
            request.parameters[key] = value
        elif key in ("sequence_start", "sequence_end", "triton_enable_empty_final_response"):
            request.parameters[key] = _bool(value, f"parameter '{key}'")
        elif key.startswith("triton_"):
            raise invalid_arg(f"parameter '{key}' is reserved: 'triton_' is a reserved prefix")
        else:
            request.parameters[key] = _scalar_param(key, value, "request")
    if request.parameters.get("sequence_start") or request.parameters.get("sequence_end"):
        sequence_id = request.parameters.get("sequence_id", 0)
        if sequence_id in (0, ""):
            raise invalid_arg(
                f"inference request to model '{request.model_name}' must specify a non-zero or non-empty "
                "sequence_id when sequence_start or sequence_end is set"
            )
    return binary_output


def _tensor_header(entry: Any, index: int, kind: str) -> tuple[str, dict[str, Any]]:
    entry = json_object(entry, f"{kind} #{index}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_arg(f"{kind} #{index} needs a 'name' string")
    params = json_object(entry.get("parameters", {}), f"{kind} '{name}' parameters")
    return name, params


def _input_shape(entry: dict[str, Any], what: str) -> tuple[int, ...]:
    shape = entry.get("shape")
    if not isinstance(shape, list):
        raise invalid_arg(f"{what} needs a 'shape' array of non-negative integers")
    return tuple(json_int(d, f"{what} shape element") for d in shape)


def decode_request(
    model_name: str, model_version: str, body: bytes | memoryview, header_length: int | None
) -> tuple[InferRequest, bool]:
    """Decode a JSON (+ binary) infer request; returns it and the request's binary_data_output flag."""
    view = memoryview(body)
    json_end = len(body) if header_length is None else header_length
    header = json_object(parse_json(view[:json_end]), "the inference request")
    request = InferRequest(model_name=model_name, model_version=model_version)
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise invalid_arg(f"request 'id' must be a string, got {json.dumps(request_id)}")
    request.id = request_id
    binary_output = _request_parameters(
        json_object(header.get("parameters", {}), "request 'parameters'"), request
    )

    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise invalid_arg("the inference request needs a non-empty 'inputs' array")
    cursor = json_end
    for i, entry in enumerate(inputs):
        name, params = _tensor_header(entry, i, "input")
        what = f"input '{name}'"
        datatype = entry.get("datatype")
        if not isinstance(datatype, str) or not datatypes.is_known(datatype):
            raise invalid_arg(
                f"{what} has unknown datatype {json.dumps(datatype)}; expected one of "
                f"{', '.join(datatypes.DATATYPES)}"
            )
        shape = _input_shape(entry, what)
        shm = _shm_ref(params, what)
        has_data = "data" in entry
        has_binary = "binary_data_size" in params
        sources = [s for s, present in (("data", has_data), ("binary_data_size", has_binary),
                                        ("shared_memory_region", shm is not None)) if present]  # fmt: skip
        if len(sources) != 1:
            raise invalid_arg(
                f"{what} must set exactly one of 'data', parameters.binary_data_size or "
                f"parameters.shared_memory_region; got {', '.join(sources) or 'none'}"
            )
        tensor = InputTensor(name, datatype, shape, shm=shm)
        tensor.parameters = {
            k: _scalar_param(k, v, what)
            for k, v in params.items()
            if k != "binary_data_size" and k not in _SHM_KEYS
        }
        if has_data:
            tensor.data = json_to_array(entry["data"], datatype, shape, what)
        elif has_binary:
            if header_length is None:
                raise invalid_arg(
                    f"{what} has parameters.binary_data_size but the request has no {HEADER_LENGTH} header"
                )
            size = json_int(params["binary_data_size"], f"{what} binary_data_size")
            if cursor + size > len(body):
                raise invalid_arg(
                    f"{what}: binary_data_size {size} runs past the end of the request body "
                    f"({len(body) - cursor} bytes of binary data left)"
                )
            tensor.data = datatypes.from_buffer(view[cursor : cursor + size], datatype, shape, what)
            cursor += size
        request.inputs.append(tensor)
    if cursor != len(body):
        raise invalid_arg(
            f"unexpected additional input data for model '{model_name}': "
            f"{len(body) - cursor} bytes after the last binary input"
        )

    outputs = header.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid_arg("request 'outputs' must be an array")
        request.outputs = [_requested_output(entry, i) for i, entry in enumerate(outputs)] or None
    return request, binary_output


def _requested_output(entry: Any, index: int) -> RequestedOutput:
    name, params = _tensor_header(entry, index, "output")
    what = f"output '{name}'"
    out = RequestedOutput(name, shm=_shm_ref(params, what))
    for key, value in params.items():
        if key == "binary_data":
            out.binary = _bool(value, f"{what} parameter 'binary_data'")
        elif key == "classification":
            out.classification = json_int(value, f"{what} parameter 'classification'")
        elif key not in _SHM_KEYS:
            out.parameters[key] = _scalar_param(key, value, what)
    if out.shm is not None:
        if out.binary:
            raise invalid_arg(f"{what}: shared memory output cannot also ask for binary_data")
        if out.classification:
            raise invalid_arg(f"{what}: shared memory output cannot be combined with classification")
    return out


def decode_raw_request(
    model_name: str, model_version: str, body: bytes | memoryview, config: ModelConfig
) -> InferRequest:
    """`Inference-Header-Content-Length: 0`: the whole body is the single input, batch 1."""
    if len(config.input) != 1:
        raise invalid_arg(
            f"raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one input; "
            f"model '{model_name}' has {len(config.input)}"
        )
    from edgeserve.server.validation import config_datatype

    spec = config.input[0]
    datatype = config_datatype(spec.data_type)
    dims = [int(d) for d in spec.dims]
    what = f"raw binary input '{spec.name}'"
    if datatype == "BYTES":
        if [d for d in dims if d != 1] and dims != [-1]:
            raise invalid_arg(f"{what}: BYTES raw requests need an input of shape [1], model has {dims}")
        shape = [1] * len(dims) if dims else [1]
        data = np.array([bytes(body)], dtype=np.object_).reshape(shape)
    else:
        if dims.count(-1) > 1:
            raise invalid_arg(f"{what}: raw requests allow at most one variable dimension, model has {dims}")
        known = 1
        for d in dims:
            known *= d if d != -1 else 1
        itemsize = datatypes.element_size(datatype)
        row = known * itemsize
        if row == 0 or len(body) % row != 0 or (-1 not in dims and len(body) != row):
            raise invalid_arg(
                f"{what}: {len(body)} bytes do not fit shape {dims} of {datatype} ({row} bytes per unit)"
            )
        shape = [len(body) // row if d == -1 else d for d in dims]
        data = None
    if config.max_batch_size > 0:
        shape = [1, *shape]
    tensor = InputTensor(spec.name, datatype, tuple(shape))
    tensor.data = (
        data if data is not None else datatypes.from_buffer(memoryview(body), datatype, tuple(shape), what)
    )
    return InferRequest(model_name=model_name, model_version=model_version, inputs=[tensor])


# -- response encoding ------------------------------------------------------------------------------
# A JSON output of more elements than this is encoded a slice at a time (each slice's C calls hold the
# GIL for milliseconds, not the seconds millions of floats take), off the event loop (`encode_off_loop`):
# one client's 4-million-float JSON answer kept the loop, and every other connection, waiting for
# 20-40 s on a busy 2-vCPU box, long enough for aiohttp to close new connections unanswered.
JSON_SLICE_ELEMENTS = 16_384


def _binary(out: Any, wanted: Mapping[str, RequestedOutput], binary_default: bool) -> bool:
    requested = wanted.get(out.name)
    return requested.binary if requested is not None and requested.binary is not None else binary_default


def json_elements(response: InferResponse, request: InferRequest, binary_default: bool) -> int:
    """How many elements of `response` go into its JSON text."""
    wanted = {o.name: o for o in (request.outputs or [])}
    return sum(
        int(np.size(out.data))
        for out in response.outputs
        if out.shm is None and out.data is not None and not _binary(out, wanted, binary_default)
    )


def encode_off_loop(response: InferResponse, request: InferRequest, binary_default: bool) -> bool:
    """Whether `encode_response` should run in a thread rather than on the event loop."""
    return json_elements(response, request, binary_default) > JSON_SLICE_ELEMENTS


def _json_data(array: Any, datatype: str) -> str:
    """`array_to_json(array)` as JSON text, one slice at a time (the same text as one json.dumps)."""
    flat = np.asarray(array).reshape(-1)
    parts = (
        json.dumps(array_to_json(flat[i : i + JSON_SLICE_ELEMENTS], datatype), separators=(",", ":"))[1:-1]
        for i in range(0, flat.size, JSON_SLICE_ELEMENTS)
    )
    return "[" + ",".join(parts) + "]"


def encode_response(
    response: InferResponse, request: InferRequest, binary_default: bool
) -> tuple[list[bytes | memoryview], int | None]:
    """(body chunks, JSON header length or None when the body is pure JSON)."""
    wanted = {o.name: o for o in (request.outputs or [])}
    sliced = json_elements(response, request, binary_default) > JSON_SLICE_ELEMENTS
    outputs: list[dict[str, Any]] = []
    texts: list[str | None] = []  # per output, its data as JSON text when sliced
    blobs: list[bytes | memoryview] = []
    for out in response.outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        params: dict[str, Any] = dict(out.parameters)
        text = None
        if out.shm is not None:
            params["shared_memory_region"] = out.shm.region
            params["shared_memory_byte_size"] = out.shm.byte_size
            if out.shm.offset:
                params["shared_memory_offset"] = out.shm.offset
        elif out.data is not None:
            if _binary(out, wanted, binary_default):
                blob = datatypes.to_wire_bytes(out.data, out.datatype)
                params["binary_data_size"] = memoryview(blob).nbytes
                blobs.append(blob)
            elif sliced:
                text = _json_data(out.data, out.datatype)
            else:
                entry["data"] = array_to_json(out.data, out.datatype)
        if params:
            entry["parameters"] = params
        outputs.append(entry)
        texts.append(text)
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = response.parameters
    if sliced:  # the same document, its big arrays spliced in as text
        entries = (
            json.dumps(entry, separators=(",", ":")) if text is None
            else json.dumps(entry, separators=(",", ":"))[:-1] + ',"data":' + text + "}"
            for entry, text in zip(outputs, texts, strict=True)
        )  # fmt: skip
        head = json.dumps(body, separators=(",", ":"))[:-1]
        header = (head + ',"outputs":[' + ",".join(entries) + "]}").encode()
    else:
        body["outputs"] = outputs
        header = json.dumps(body, separators=(",", ":")).encode()
    if not blobs:
        return [header], None
    return [header, *blobs], len(header)
