"""The unary RPCs of `inference.GRPCInferenceService`, each a thin translation onto the data plane.

Handlers raise `InferenceError`; `guarded` turns it into the gRPC status Triton would send (and any
other exception into INTERNAL), so no handler calls `context.abort` itself.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from edgeserve.frontends import access
from edgeserve.frontends.grpc import codec, wire
from edgeserve.frontends.grpc.auth import AccessPolicy, GrpcPeer, check
from edgeserve.frontends.peer import grpc_peer
from edgeserve.frontends.shm.registry import TRITON_OWNER, ShmClient
from edgeserve.protocol.errors import InferenceError, Status, internal, invalid_arg, not_found, unsupported
from edgeserve.scheduling.job import CURRENT_CLIENT

if TYPE_CHECKING:
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.grpc")

Context: TypeAlias = Any  # grpc.aio.ServicerContext (grpcio ships no type hints)
Handler = Callable[[Any, Context], Coroutine[Any, Any, Any]]


def grpc_code(error: InferenceError) -> grpc.StatusCode:
    return grpc.StatusCode[error.grpc_status_name]


def peer_client(context: Context) -> str:
    """The peer's address without its port ("ipv4:10.0.0.7"), for fair shares between clients."""
    try:
        peer = str(context.peer() or "")
    except Exception:  # pragma: no cover - a context without a peer
        return ""
    head, sep, tail = peer.rpartition(":")
    return head if sep and tail.isdigit() else peer


def shm_client(context: Context, local_port: int) -> ShmClient:
    """Who names shm regions: its user is looked up only when it does (shm/binding.py), per call (no
    per-connection object to keep it on: a peer address may be another process's once it is free)."""
    return ShmClient(lambda: grpc_peer(str(context.peer() or ""), local_port or None))


def guarded(
    handler: Handler, policy: AccessPolicy, endpoint: access.Endpoint | None = None, tag_client: bool = False
) -> Handler:
    """Access check (`endpoint`: what the RPC does), malformed-request answer and error mapping around
    one unary handler.

    `tag_client`: the RPC's jobs carry the peer's address (fair shares of a full model queue)."""
    checked = policy.needs_check(endpoint)  # the settings are fixed for the frontend's life

    async def call(request: Any, context: Context) -> Any:
        # CURRENT_CLIENT directly, not client_scope(): a generator context manager per RPC costs ~2 µs
        token = CURRENT_CLIENT.set(peer_client(context)) if tag_client else None
        try:
            if checked:
                policy.check(endpoint, GrpcPeer(context))
            if isinstance(request, wire.Malformed):
                raise internal(request.message)
            return await handler(request, context)
        except InferenceError as exc:
            error = exc
        except Exception as exc:  # a bug here must not take the server down
            log.exception("grpc handler %s failed", getattr(handler, "__name__", handler))
            error = internal(f"internal error: {exc}")
        finally:
            if token is not None:
                CURRENT_CLIENT.reset(token)
        await context.abort(grpc_code(error), error.message)

    call.__name__ = getattr(handler, "__name__", "handler")
    return call


def _tensor_metadata(entries: list[dict[str, Any]], target: Any) -> None:
    for entry in entries:
        target.add(name=entry["name"], datatype=entry["datatype"], shape=[int(d) for d in entry["shape"]])


def _load_parameters(request: service_pb2.RepositoryModelLoadRequest) -> tuple[str | None, dict[str, bytes]]:
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, param in request.parameters.items():
        kind = param.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise invalid_arg(
                    "load parameter 'config' must be a string_param holding the model config JSON"
                )
            config = param.string_param
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise invalid_arg(f"load parameter {key[:120]!r} must be a bytes_param")
            path = key[len("file:") :]
            normalized = posixpath.normpath(path)
            if not path or path.startswith("/") or normalized.startswith("..") or "\\" in path:
                raise invalid_arg(
                    f"load parameter {key[:120]!r}: file paths must be relative to the model folder"
                )
            files[path] = param.bytes_param  # as sent: the repository checks every name (layout.py)
        else:
            raise invalid_arg(
                f"unrecognized load parameter {key[:120]!r}; expected 'config' or 'file:<path>'"
            )
    if files and config is None:
        raise invalid_arg("load parameters with 'file:' content need a 'config' parameter too")
    return config, files


class InferenceServicer:
    def __init__(self, dataplane: DataPlane, policy: AccessPolicy, max_message_bytes: int) -> None:
        self.dataplane = dataplane
        self.policy = policy
        self.max_message_bytes = max_message_bytes
        self.inline_max_ns = 0  # set by the frontend ([grpc] inline_max_us)
        self.local_port = 0  # the bound port, set by the frontend: finds a loopback client's socket

    # -- health and metadata ------------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerLiveResponse(live=self.dataplane.live())

    async def ServerReady(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.dataplane.ready())

    async def ModelReady(self, request: Any, context: Context) -> Any:
        try:
            ready = self.dataplane.model_ready(request.name, request.version)
        except InferenceError as exc:
            if exc.status not in (Status.NOT_FOUND, Status.UNAVAILABLE):
                raise
            ready = False  # Triton: an unknown model is simply not ready
        return service_pb2.ModelReadyResponse(ready=bool(ready))

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        meta = self.dataplane.server_metadata()
        return service_pb2.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=list(meta["extensions"])
        )

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        meta = self.dataplane.model_metadata(request.name, request.version)
        response = service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"]
        )
        _tensor_metadata(meta["inputs"], response.inputs)
        _tensor_metadata(meta["outputs"], response.outputs)
        return response

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        response = service_pb2.ModelConfigResponse()
        response.config.CopyFrom(self.dataplane.model_config(request.name, request.version))
        return response

    async def ModelStatistics(self, request: Any, context: Context) -> Any:
        stats = self.dataplane.statistics(request.name, request.version)
        try:
            return json_format.ParseDict(
                stats, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True
            )
        except json_format.ParseError as exc:
            raise internal(f"statistics do not fit ModelStatisticsResponse: {exc}") from None

    # -- inference ------------------------------------------------------------------------------
    async def ModelInfer(self, request: wire.DecodedInfer, context: Context) -> bytes:
        # UNAVAILABLE at once when the server holds its in-flight limit or the model's queue is full
        self.dataplane.admit(request.message.model_name, request.message.model_version)
        try:
            infer_request = codec.to_infer_request(request)
        except BaseException:
            self.dataplane.release()
            raise
        infer_request.shm_client = shm_client(context, self.local_port)
        response = await self.dataplane.infer(infer_request, admitted=True, inline_max_ns=self.inline_max_ns)
        return codec.encode_response(response, self.max_message_bytes)

    # -- repository -----------------------------------------------------------------------------
    async def RepositoryIndex(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            raise unsupported("'repository_name' specification is not supported")
        response = service_pb2.RepositoryIndexResponse()
        for entry in self.dataplane.repository_index(request.ready):
            response.models.add(
                name=str(entry.get("name", "")),
                version=str(entry.get("version", "")),
                state=str(entry.get("state", "")),
                reason=str(entry.get("reason", "")),
            )
        return response

    async def RepositoryModelLoad(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            raise unsupported("'repository_name' specification is not supported")
        if not request.model_name:
            raise invalid_arg("model_name must not be empty")
        config, files = _load_parameters(request)
        await self.dataplane.load_model(request.model_name, config, files or None)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            raise unsupported("'repository_name' specification is not supported")
        unload_dependents = False
        for key, param in request.parameters.items():
            if key == "unload_dependents":
                if param.WhichOneof("parameter_choice") != "bool_param":
                    raise invalid_arg("unload parameter 'unload_dependents' must be a bool_param")
                unload_dependents = param.bool_param
            else:
                raise invalid_arg(f"unrecognized unload parameter '{key}'")
        await self.dataplane.unload_model(request.model_name, unload_dependents)
        return service_pb2.RepositoryModelUnloadResponse()

    # -- shared memory --------------------------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        response = service_pb2.SystemSharedMemoryStatusResponse()
        client = shm_client(context, self.local_port)
        for info in self.dataplane.shm.status(request.name, owner=TRITON_OWNER, client=client):
            entry = response.regions[info.name]
            entry.name, entry.key, entry.offset, entry.byte_size = (
                info.name,
                info.key,
                info.offset,
                info.byte_size,
            )
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        shm = self.dataplane.shm
        peer = shm_client(context, self.local_port).peer
        shm.register(request.name, request.key, request.offset, request.byte_size, TRITON_OWNER, peer)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        self.dataplane.shm.unregister_triton(request.name, shm_client(context, self.local_port))
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        if request.name:
            raise not_found(f"Unable to find cuda shared memory region: '{request.name}'")
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        raise unsupported(
            "CUDA shared memory is not supported by edgeserve on this device (no GPU backend with CUDA IPC); "
            "use system shared memory"
        )

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        return service_pb2.CudaSharedMemoryUnregisterResponse()  # no CUDA region can exist

    # -- settings -------------------------------------------------------------------------------
    async def TraceSetting(self, request: Any, context: Context) -> Any:
        raise unsupported("the trace extension is not supported by edgeserve")

    async def LogSettings(self, request: Any, context: Context) -> Any:
        updates: dict[str, Any] = {}
        for key, value in request.settings.items():
            kind = value.WhichOneof("parameter_choice")
            if kind is None:
                raise invalid_arg(f"log setting '{key}' has no value")
            updates[key] = getattr(value, kind)
        if updates:
            check(self.policy, context, access.LOG_UPDATE)
        current = self.dataplane.log_settings(updates or None)
        response = service_pb2.LogSettingsResponse()
        for key, setting in current.items():
            target = response.settings[key]
            if isinstance(setting, bool):
                target.bool_param = setting
            elif isinstance(setting, int):
                target.uint32_param = setting
            else:
                target.string_param = str(setting)
        return response
