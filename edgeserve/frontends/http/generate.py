"""Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate` and `/generate_stream`.

Request: a JSON object. A key that names a model input is that tensor (a string, number or boolean is
one element, an array its elements, flattened; a batching model gets a batch of one); "parameters"
(an object of strings, numbers and booleans) and any other key are request parameters. Response: one
JSON object per model response: "model_name", "model_version" and each output by name (one element:
the value, else the flat list; BYTES as text).

`/generate` answers once (application/json). A decoupled model must send exactly one response for
it; more is an error that points to `/generate_stream`. `/generate_stream` sends each response as one
server-sent event (`data: {...}`), in order; an error before the first response is a normal JSON error
with its HTTP status, a later one is an `{"error": ...}` event (the status was 200 already). The events
leave as the client reads them: a slow reader slows the model (the data plane's stream bound), and a
client that goes away cancels the request (the model sees `cancelled`).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edgeserve.frontends.http import codec
from edgeserve.frontends.http.jsontensor import array_to_json, json_to_array
from edgeserve.protocol.errors import InferenceError, Status, invalid_arg
from edgeserve.protocol.inference import InferRequest, InferResponse, InputTensor
from edgeserve.server.dataplane import on_loop
from edgeserve.server.validation import config_datatype

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

    from edgeserve.server.dataplane import DataPlane
    from edgeserve.server.streaming import ResponseStream, StreamItem

SSE = "text/event-stream; charset=utf-8"
MORE_THAN_ONE = (
    "model '{model}' sent more than one response: /generate answers with exactly one; use /generate_stream"
)
_GONE_CHECK_S = 1.0  # how often a wait for the model checks that the client is still connected


def to_request(name: str, version: str, body: dict[str, Any], config: ModelConfig) -> InferRequest:
    inputs = {t.name: t for t in config.input}
    request = InferRequest(name, version)
    for key, value in body.items():
        if key == "parameters":
            if not isinstance(value, dict):
                raise invalid_arg("'parameters' must be a JSON object")
            for param, item in value.items():
                request.parameters[param] = _parameter(param, item)
        elif key in inputs:
            request.inputs.append(_tensor(key, value, inputs[key].data_type, config.max_batch_size > 0))
        else:
            request.parameters[key] = _parameter(key, value)
    return request


def _parameter(key: str, value: Any) -> Any:
    if not isinstance(value, (str, int, float, bool)):
        raise invalid_arg(f"parameter '{key}' must be a string, number or boolean")
    return value


def _tensor(name: str, value: Any, data_type: int, batched: bool) -> InputTensor:
    datatype = config_datatype(data_type)
    data = value if isinstance(value, list) else [value]
    count = len(_flat(data))
    shape = (1, count) if batched else (count,)
    return InputTensor(name, datatype, shape, json_to_array(data, datatype, shape, f"input '{name}'"))


def _flat(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:  # iterative: a deeply nested body cannot exhaust the recursion limit
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def to_json(response: InferResponse) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    for tensor in response.outputs:
        if tensor.data is None:
            continue  # written to shared memory (not asked for through generate)
        values = array_to_json(tensor.data, tensor.datatype)
        out[tensor.name] = values[0] if len(values) == 1 else values
    return out


async def _next(stream: ResponseStream, wake: asyncio.Event, request: web.Request) -> list[StreamItem]:
    """The responses the stream holds, waiting for at least one; ConnectionResetError when the
    client went away meanwhile."""
    while True:
        wake.clear()
        items = stream.take()  # after clear: a notify from now on sets `wake` again
        if items:
            return items
        try:
            await asyncio.wait_for(wake.wait(), _GONE_CHECK_S)
        except asyncio.TimeoutError:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client left during generate") from None


async def handle(dataplane: DataPlane, request: web.Request, raw: bytes) -> web.StreamResponse:
    """`raw`: the request body, read after `dataplane.admit` counted the request (released here)."""
    name, version = request.match_info["model"], request.match_info.get("version", "")
    streaming = request.path.endswith("/generate_stream")
    try:
        body = codec.json_object(codec.parse_json(raw), "generate request")
        infer_request = to_request(name, version, body, await dataplane.config_for_request(name, version))
    except BaseException:
        dataplane.release()
        raise
    wake = asyncio.Event()
    notify = on_loop(asyncio.get_running_loop(), lambda _stream: wake.set())

    def on_response(stream: ResponseStream) -> None:
        try:
            notify(stream)
        except RuntimeError:  # the loop is closed: nobody reads
            stream.cancel()

    stream = dataplane.submit_stream(infer_request, on_response, admitted=True)
    try:
        if streaming:
            return await _events(stream, wake, request)
        return await _single(name, stream, wake, request)
    finally:
        if not stream.ended:
            stream.cancel()  # the client went away (or a bug): the model sees cancelled


async def _single(
    name: str, stream: ResponseStream, wake: asyncio.Event, request: web.Request
) -> web.Response:
    answer: InferResponse | None = None
    while True:
        for result, final in await _next(stream, wake, request):
            if isinstance(result, InferenceError):
                raise result
            if result is not None:
                if answer is not None:
                    raise InferenceError(Status.INVALID_ARG, MORE_THAN_ONE.format(model=name))
                answer = result
            if final:
                if answer is None:
                    raise InferenceError(Status.INTERNAL, f"model '{name}' sent no response")
                return web.json_response(to_json(answer))


async def _events(
    stream: ResponseStream, wake: asyncio.Event, request: web.Request
) -> web.StreamResponse:
    items = await _next(stream, wake, request)
    first, final = items[0]
    if isinstance(first, InferenceError) and final:
        raise first  # failed before any response: a JSON error with its status
    response = web.StreamResponse(headers={"Content-Type": SSE, "Cache-Control": "no-cache"})
    await response.prepare(request)
    while True:
        for result, final in items:
            if isinstance(result, InferenceError):
                event: dict[str, Any] | None = {"error": result.message}
            else:
                event = to_json(result) if result is not None else None
            if event is not None:
                # write() waits while the transport's buffer is full: the client's pace reaches the model
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if final:
                await response.write_eof()
                return response
        items = await _next(stream, wake, request)
