"""The server's own description and counters, over the protocol under test: model metadata and config
(to build inputs) and Triton's statistics extension (the server-side queue / compute split).

HTTP and gRPC speak the KServe V2 protocol, so any such server answers; the config and statistics
are Triton extensions a server may lack (the bench then runs without them). Over ZeroMQ the metadata
comes from edgeserve's ZeroMQ endpoint and the config and statistics from its HTTP endpoint
(`--stats-url`), when that answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from edgeserve.bench.errors import BenchError
from edgeserve.bench.inputs import ModelInfo, model_info
from edgeserve.bench.stats import Counters

CONNECT_TIMEOUT_S = 5.0
ZMQ_CONNECT_TIMEOUT_S = 2.5  # the client's send timeout too: an absent server costs about twice this


def http_base(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


def grpc_target(url: str) -> str:
    for prefix in ("grpc://", "http://"):
        if url.startswith(prefix):
            return url[len(prefix) :]
    return url


def grpc_metadata(headers: Mapping[str, str] | None) -> tuple[tuple[str, str], ...] | None:
    """-H headers as gRPC metadata (keys lower-case, as gRPC requires)."""
    return tuple((k.lower(), v) for k, v in headers.items()) if headers else None


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{quote(model, safe='')}"
    return path + (f"/versions/{quote(version, safe='')}" if version else "")


class ServerApi(Protocol):
    async def model_info(self, model: str, version: str) -> ModelInfo: ...

    async def counters(self, model: str, version: str) -> Counters | None: ...

    async def close(self) -> None: ...


class HttpApi:
    def __init__(self, url: str, timeout_s: float = 30.0, headers: Mapping[str, str] | None = None) -> None:
        import aiohttp

        self.base = http_base(url)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s), headers=dict(headers or {})
        )

    async def _get(self, path: str) -> tuple[int, Any]:
        import aiohttp

        try:
            async with self._session.get(self.base + path) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise BenchError(
                f"cannot reach {self.base}: {exc or type(exc).__name__} (is the server running?)"
            ) from None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        return status, body

    async def live(self) -> None:
        status, _ = await self._get("/v2/health/live")
        if status != 200:
            raise BenchError(f"{self.base}/v2/health/live answered {status}: not a live KServe V2 server")

    async def model_info(self, model: str, version: str) -> ModelInfo:
        await self.live()
        status, meta = await self._get(_model_path(model, version))
        if status != 200 or not isinstance(meta, dict):
            detail = meta.get("error", meta) if isinstance(meta, dict) else meta
            raise BenchError(f"model '{model}' on {self.base}: {status}: {detail}")
        return model_info(meta, await self.config(model, version), version)

    async def config(self, model: str, version: str) -> dict[str, Any] | None:
        status, config = await self._get(_model_path(model, version) + "/config")
        return config if status == 200 and isinstance(config, dict) else None

    async def counters(self, model: str, version: str) -> Counters | None:
        try:
            status, stats = await self._get(_model_path(model, version) + "/stats")
        except BenchError:
            return None
        return Counters.from_json(stats) if status == 200 and isinstance(stats, dict) else None

    async def close(self) -> None:
        await self._session.close()


class GrpcApi:
    def __init__(self, url: str, timeout_s: float = 30.0, headers: Mapping[str, str] | None = None) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.target = grpc_target(url)
        self.timeout_s = timeout_s
        self.metadata = grpc_metadata(headers)
        self._channel = grpc.aio.insecure_channel(self.target)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        import grpc

        try:
            call = getattr(self._stub, method)
            return await call(request, timeout=timeout or self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BenchError(
                    f"cannot reach gRPC server {self.target}: {exc.code().name}: {exc.details()} "
                    "(is the server running?)"
                ) from None
            raise

    async def model_info(self, model: str, version: str) -> ModelInfo:
        import grpc
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        await self._call("ServerLive", pb.ServerLiveRequest(), CONNECT_TIMEOUT_S)
        try:
            meta = await self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version))
        except grpc.aio.AioRpcError as exc:
            raise BenchError(
                f"model '{model}' on {self.target}: {exc.code().name}: {exc.details()}"
            ) from None
        config: dict[str, Any] | None = None
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
            config = json_format.MessageToDict(reply.config, preserving_proto_field_name=True)
        return model_info(json_format.MessageToDict(meta, preserving_proto_field_name=True), config, version)

    async def counters(self, model: str, version: str) -> Counters | None:
        import grpc
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        try:
            reply = await self._call(
                "ModelStatistics", pb.ModelStatisticsRequest(name=model, version=version)
            )
        except (grpc.aio.AioRpcError, BenchError):
            return None
        return Counters.from_json(json_format.MessageToDict(reply, preserving_proto_field_name=True))

    async def close(self) -> None:
        await self._channel.close()


def _quiet_lost_client_futures() -> None:
    """AsyncZmqClient, when its send times out (no server), leaves the request's future failed with
    nobody to read it; asyncio would print "Future exception was never retrieved" under our one-line
    error. Those (ClientError only) are dropped; everything else goes to the default handler."""
    from edgeserve.client import ClientError

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ClientError) and "never retrieved" in str(
            context.get("message")
        ):
            return
        loop.default_exception_handler(context)

    asyncio.get_running_loop().set_exception_handler(handler)


class ZmqApi:
    """Metadata over edgeserve's ZeroMQ endpoint; config and statistics over its HTTP endpoint."""

    def __init__(self, endpoint: str, stats_url: str | None, timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._http = HttpApi(stats_url, timeout_s) if stats_url else None
        self._http_ok = self._http is not None

    async def model_info(self, model: str, version: str) -> ModelInfo:
        from edgeserve.client import AsyncZmqClient, ClientError

        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[len("ipc://") :]).exists():
            raise BenchError(
                f"cannot reach edgeserve's ZeroMQ endpoint {self.endpoint}: no such socket file "
                "(is the server running?)"
            )
        _quiet_lost_client_futures()
        client = AsyncZmqClient(self.endpoint, timeout=ZMQ_CONNECT_TIMEOUT_S)
        try:
            meta = await client.metadata(model, version)
        except ClientError as exc:
            if exc.status in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
                raise BenchError(
                    f"cannot reach edgeserve's ZeroMQ endpoint {self.endpoint}: {exc.message}"
                ) from None
            raise BenchError(f"model '{model}' on {self.endpoint}: {exc.status}: {exc.message}") from None
        finally:
            await client.close()
        config: Mapping[str, Any] | None = None
        if self._http is not None:
            try:
                config = await self._http.config(model, version)
            except BenchError:
                self._http_ok = False
        return model_info(meta, config, version)

    async def counters(self, model: str, version: str) -> Counters | None:
        if self._http is None or not self._http_ok:
            return None
        return await self._http.counters(model, version)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
