"""KServe V2 / Triton HTTP routes. Handlers only translate HTTP <-> the data plane."""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib
import logging
import zlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edgeserve.backends.streams import http_wording
from edgeserve.frontends.http import codec
from edgeserve.frontends.http.admin import config_to_json
from edgeserve.frontends.http.tensor_body import read_tensor_body
from edgeserve.frontends.peer import transport_peer
from edgeserve.frontends.shm.registry import TRITON_OWNER, ShmClient
from edgeserve.protocol.errors import InferenceError, Status, invalid_arg, unavailable, unsupported

if TYPE_CHECKING:
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.http")

JSON = "application/json"
BINARY = "application/octet-stream"
_OFFLOAD_BYTES = 256 * 1024  # (de)compress bigger bodies off the event loop
_VERSION = r"{version:[0-9]+}"


class HttpError(Exception):
    """An HTTP-only error (413 and friends) with a JSON body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# -- body helpers -------------------------------------------------------------------------------------
def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """gzip / deflate (zlib, or raw deflate) with the decompressed size bounded by `limit`."""
    attempts = [16 + zlib.MAX_WBITS] if encoding == "gzip" else [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    error: zlib.error | None = None
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            error = exc
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise HttpError(413, f"decompressed request body exceeds the maximum of {limit} bytes")
        if not inflater.eof:
            raise invalid_arg(f"the {encoding} request body is truncated")
        return out
    raise invalid_arg(f"failed to decompress the {encoding} request body: {error}")


def _compress(chunks: list[bytes | memoryview], encoding: str) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    deflater = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return b"".join([*(deflater.compress(c) for c in chunks), deflater.flush()])


# Deflating float tensor bytes costs ~1.5 ms per 64 KB here and saves ~10%; a mask or a JSON body
# shrinks many times over. A body of at least _SAMPLED_BYTES whose largest part does not shrink below
# _SHRINK_RATIO in a 1 KB sample goes out as identity, which Accept-Encoding allows unless refused.
_SAMPLED_BYTES = 4096
_SAMPLE = 1024
_SHRINK_RATIO = 0.8


def _pays_to_compress(chunks: list[bytes | memoryview], size: int) -> bool:
    if size < _SAMPLED_BYTES:
        return True
    largest = max(chunks, key=lambda chunk: memoryview(chunk).nbytes)
    try:
        sample = memoryview(largest).cast("B")[:_SAMPLE].tobytes()
    except (TypeError, ValueError):  # not a plain contiguous buffer: compress as asked
        return True
    return len(zlib.compress(sample, 1)) < _SHRINK_RATIO * len(sample)


def _identity_refused(offered: dict[str, float]) -> bool:
    """Accept-Encoding says "identity;q=0", or "*;q=0" without naming identity (RFC 9110 12.5.3)."""
    if "identity" in offered:
        return offered["identity"] <= 0
    return offered.get("*", 1.0) <= 0


def _offered(header: str | None) -> dict[str, float]:
    """Accept-Encoding as coding -> quality ({} when absent)."""
    offered: dict[str, float] = {}
    for token in (header or "").split(","):
        if not token.strip():
            continue
        name, _, params = token.strip().partition(";")
        quality = 1.0
        if params.strip().startswith("q="):
            try:
                quality = float(params.strip()[2:])
            except ValueError:
                quality = 0.0
        offered[name.strip().lower()] = quality
    return offered


def _accepted_encoding(offered: dict[str, float]) -> str | None:
    for candidate in ("gzip", "deflate"):
        if offered.get(candidate, 0.0) > 0:
            return candidate
    return None


async def _json_body(request: web.Request, max_bytes: int) -> Any:
    """An optional JSON object body (empty body -> {})."""
    body = await read_body(request, max_bytes)
    if not body.strip():
        return {}
    return codec.parse_json(body)


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    if request.content_length is not None and request.content_length > max_bytes:
        raise HttpError(
            413, f"request body of {request.content_length} bytes exceeds the maximum of {max_bytes}"
        )
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"request body exceeds the maximum of {max_bytes} bytes") from None
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise invalid_arg(f"unsupported Content-Encoding '{encoding}'; use gzip or deflate")
    if len(body) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(_decompress, body, encoding, max_bytes)
    return _decompress(body, encoding, max_bytes)


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _shm_client(request: web.Request) -> ShmClient:
    """Who names shm regions: its user is looked up only when it does, once per connection
    (shm/binding.py)."""
    transport = request.transport
    return ShmClient(lambda: transport_peer(transport))


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


# -- handlers ------------------------------------------------------------------------------------------
class Routes:
    def __init__(self, dataplane: DataPlane, max_input_bytes: int) -> None:
        self.dataplane = dataplane
        self.max_input_bytes = max_input_bytes
        self.inline_max_ns = 0  # set by the frontend ([http] inline_max_us)

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/models/stats", self.stats)
        r.add_get("/v2/logging", self.get_logging)
        r.add_post("/v2/logging", self.update_logging)
        r.add_get("/v2/trace/setting", self.get_trace)
        r.add_post("/v2/trace/setting", self.update_trace)
        for prefix in ("/v2/models/{model}", f"/v2/models/{{model}}/versions/{_VERSION}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.stats)
            r.add_post(prefix + "/infer", self.infer)
            r.add_post(prefix + "/generate", self.generate)
            r.add_post(prefix + "/generate_stream", self.generate)
        r.add_get("/v2/models/{model}/trace/setting", self.get_trace)
        r.add_post("/v2/models/{model}/trace/setting", self.update_trace)
        for prefix in ("/v2/repository", "/v2/repository/{repository}"):
            r.add_post(prefix + "/index", self.repository_index)
            r.add_post(prefix + "/models/{model}/load", self.load)
            r.add_post(prefix + "/models/{model}/unload", self.unload)
        for kind in ("system", "cuda"):
            base = f"/v2/{kind}sharedmemory"
            r.add_get(base + "/status", self.shm_status)
            r.add_get(base + "/region/{region}/status", self.shm_status)
            r.add_post(base + "/region/{region}/register", self.shm_register)
            r.add_post(base + "/unregister", self.shm_unregister)
            r.add_post(base + "/region/{region}/unregister", self.shm_unregister)
        r.add_get("/metrics", self.metrics)

    # health and metadata
    async def live(self, request: web.Request) -> web.Response:
        return _empty(200 if self.dataplane.live() else 400)

    async def ready(self, request: web.Request) -> web.Response:
        return _empty(200 if self.dataplane.ready() else 400)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.dataplane.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.dataplane.model_metadata(*_model(request)))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        if self.dataplane.model_ready(name, version):
            return _empty(200)
        label = f"'{name}'" + (f" version {version}" if version else "")
        return error_response(400, f"Model {label} is not ready")

    async def model_config(self, request: web.Request) -> web.Response:
        return web.json_response(config_to_json(self.dataplane.model_config(*_model(request))))

    async def stats(self, request: web.Request) -> web.Response:
        name = request.match_info.get("model", "")
        return web.json_response(self.dataplane.statistics(name, request.match_info.get("version", "")))

    # inference
    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        # Admission before the body is read: an overloaded server answers 503 at once and spends
        # nothing on the tensors (aiohttp drains the unread body and keeps the connection).
        self.dataplane.admit(name, version)
        try:
            # binary tensors: into an aligned buffer (tensor_body.py); else as any other body
            body = await read_tensor_body(request, self.max_input_bytes) or await read_body(
                request, self.max_input_bytes
            )
            header_length = codec.parse_header_length(request.headers.get(codec.HEADER_LENGTH), len(body))
            if header_length == 0:
                infer_request = codec.decode_raw_request(
                    name, version, body, await self.dataplane.config_for_request(name, version)
                )
                binary_default = True
            else:
                infer_request, binary_default = codec.decode_request(name, version, body, header_length)
        except BaseException:
            self.dataplane.release()
            raise
        infer_request.shm_client = _shm_client(request)
        try:
            response = await self.dataplane.infer(
                infer_request, admitted=True, inline_max_ns=self.inline_max_ns
            )
        except InferenceError as exc:
            raise http_wording(exc) from None
        if request.transport is None or request.transport.is_closing():  # gone: encode nothing for nobody
            raise ConnectionResetError("the client left before its answer")
        if codec.encode_off_loop(response, infer_request, binary_default):  # big JSON: the loop keeps serving
            encoded = await asyncio.to_thread(codec.encode_response, response, infer_request, binary_default)
        else:
            encoded = codec.encode_response(response, infer_request, binary_default)
        chunks, json_length = encoded
        headers: dict[str, str] = {}
        if json_length is None:
            headers["Content-Type"] = JSON
        else:
            headers["Content-Type"] = BINARY
            headers[codec.HEADER_LENGTH] = str(json_length)
        offered = _offered(request.headers.get("Accept-Encoding"))
        encoding = _accepted_encoding(offered)
        size = sum(memoryview(c).nbytes for c in chunks) if encoding is not None else 0
        if encoding is not None and (_pays_to_compress(chunks, size) or _identity_refused(offered)):
            payload = (
                await asyncio.to_thread(_compress, chunks, encoding)
                if size > _OFFLOAD_BYTES
                else _compress(chunks, encoding)
            )
            headers["Content-Encoding"] = encoding
        else:
            payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # type: ignore[assignment]
        return web.Response(body=payload, headers=headers)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Triton's generate extension (/generate and /generate_stream): generate.py."""
        from edgeserve.frontends.http.generate import handle

        name, version = _model(request)
        self.dataplane.admit(name, version)  # before the body is read, as /infer
        try:
            raw = await read_body(request, self.max_input_bytes)
        except BaseException:
            self.dataplane.release()
            raise
        return await handle(self.dataplane, request, raw)

    # repository
    def _check_repository(self, request: web.Request) -> None:
        if request.match_info.get("repository"):
            raise unsupported("'repository_name' specification is not supported")

    async def repository_index(self, request: web.Request) -> web.Response:
        self._check_repository(request)
        body = codec.json_object(await _json_body(request, self.max_input_bytes), "repository index request")
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise invalid_arg("'ready' must be true or false")
        return web.json_response(self.dataplane.repository_index(ready))

    async def load(self, request: web.Request) -> web.Response:
        self._check_repository(request)
        name = request.match_info["model"]
        body = codec.json_object(await _json_body(request, self.max_input_bytes), "load request")
        params = codec.json_object(body.get("parameters", {}), "load request 'parameters'")
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, value in params.items():
            if key == "config":
                if not isinstance(value, str):
                    raise invalid_arg(
                        "load parameter 'config' must be a string holding the model config JSON"
                    )
                config = value
            elif key.startswith("file:"):
                if not isinstance(value, str):
                    raise invalid_arg(f"load parameter {key[:120]!r} must be a base64 string")
                try:
                    files[key[len("file:") :]] = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise invalid_arg(f"load parameter {key[:120]!r} is not valid base64: {exc}") from None
            else:
                log.info("load of %r: ignoring unknown parameter %r", name[:120], key[:120])
        if files and config is None:
            raise invalid_arg(f"failed to load '{name}': file override parameters need a 'config' parameter")
        log.info(
            "load requested: model=%r config_override=%s files=%d", name[:120], config is not None, len(files)
        )
        await self.dataplane.load_model(name, config, files or None)
        return _empty(200)

    async def unload(self, request: web.Request) -> web.Response:
        self._check_repository(request)
        name = request.match_info["model"]
        body = codec.json_object(await _json_body(request, self.max_input_bytes), "unload request")
        params = codec.json_object(body.get("parameters", {}), "unload request 'parameters'")
        dependents = params.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise invalid_arg("unload parameter 'unload_dependents' must be true or false")
        log.info("unload requested: model=%s", name)
        await self.dataplane.unload_model(name, dependents)
        return _empty(200)

    # shared memory
    @staticmethod
    def _is_cuda(request: web.Request) -> bool:
        return request.path.startswith("/v2/cudasharedmemory")

    async def shm_status(self, request: web.Request) -> web.Response:
        region = request.match_info.get("region", "")
        if self._is_cuda(request):
            if region:
                raise InferenceError(
                    Status.NOT_FOUND, f"Unable to find cuda shared memory region: '{region}'"
                )
            return web.json_response([])
        regions = self.dataplane.shm.status(region, owner=TRITON_OWNER, client=_shm_client(request))
        return web.json_response([info.as_dict() for info in regions])

    async def shm_register(self, request: web.Request) -> web.Response:
        if self._is_cuda(request):
            raise unsupported("CUDA shared memory is not supported by edgeserve; use system shared memory")
        region = request.match_info["region"]
        body = codec.json_object(
            await _json_body(request, self.max_input_bytes), "shared memory register request"
        )
        key = body.get("key")
        if not isinstance(key, str) or not key:
            raise invalid_arg("shared memory register request needs a 'key' string")
        if "byte_size" not in body:
            raise invalid_arg("shared memory register request needs 'byte_size'")
        offset = codec.json_int(body.get("offset", 0), "'offset'")
        byte_size = codec.json_int(body["byte_size"], "'byte_size'")
        peer = _shm_client(request).peer
        self.dataplane.shm.register(region, key, offset, byte_size, TRITON_OWNER, peer)
        return _empty(200)

    async def shm_unregister(self, request: web.Request) -> web.Response:
        if not self._is_cuda(request):
            self.dataplane.shm.unregister_triton(request.match_info.get("region", ""), _shm_client(request))
        return _empty(200)

    # logging, trace, metrics
    async def get_logging(self, request: web.Request) -> web.Response:
        return web.json_response(self.dataplane.log_settings())

    async def update_logging(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.max_input_bytes)
        return web.json_response(self.dataplane.log_settings(body))

    async def get_trace(self, request: web.Request) -> web.Response:
        return web.json_response({
            "trace_file": "", "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
            "log_frequency": "0", "trace_mode": "triton",
        })  # fmt: skip

    async def update_trace(self, request: web.Request) -> web.Response:
        raise unsupported("tracing is not supported by edgeserve; see /metrics and the statistics endpoints")

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            metrics = importlib.import_module("edgeserve.metrics")
        except ImportError as exc:
            raise unavailable(f"metrics are not available: {exc}") from None
        payload, content_type = metrics.render(self.dataplane.repository.served())
        return web.Response(body=payload, headers={"Content-Type": content_type})
