"""The standard `grpc.health.v1.Health` service (grpcio-health-checking), answering from the data plane.

Like Triton, SERVING means the server is live. The overall service ("") and
"inference.GRPCInferenceService" are both known; Check re-reads liveness on every call, and Watch
streams see the change at the next Check or when the frontend stops. Access as ServerLive: no token
needed, Triton's restricted `health` category applies.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import grpc

from edgeserve.frontends.access import SERVER_HEALTH, AccessPolicy
from edgeserve.frontends.grpc.auth import check
from edgeserve.protocol.errors import InferenceError

if TYPE_CHECKING:
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.grpc")

SERVICE_NAMES = ("", "inference.GRPCInferenceService")


class HealthService:
    """Wraps grpc_health's asyncio servicer; inert (with a warning) when the package is missing."""

    def __init__(self, dataplane: DataPlane, policy: AccessPolicy | None = None) -> None:
        self.dataplane = dataplane
        self._servicer: Any = None
        try:
            from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        except ImportError:
            log.warning("grpcio-health-checking is not installed: grpc.health.v1.Health is not served")
            return
        self._pb2 = health_pb2
        self._pb2_grpc = health_pb2_grpc
        outer = self

        async def allowed(context: Any) -> None:
            if policy is None:
                return
            try:
                check(policy, context, SERVER_HEALTH)
            except InferenceError as exc:
                await context.abort(grpc.StatusCode[exc.grpc_status_name], exc.message)

        class _Servicer(health.aio.HealthServicer):  # type: ignore[misc]
            async def Check(self, request: Any, context: Any) -> Any:
                await allowed(context)
                await outer.refresh()
                return await super().Check(request, context)

            async def Watch(self, request: Any, context: Any) -> None:
                await allowed(context)
                await super().Watch(request, context)

        self._servicer = _Servicer()

    def add_to(self, server: grpc.aio.Server) -> None:
        if self._servicer is not None:
            self._pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def _status(self) -> Any:
        serving = self.dataplane.live() and not self.dataplane.shutting_down
        codes = self._pb2.HealthCheckResponse
        return codes.SERVING if serving else codes.NOT_SERVING

    async def refresh(self) -> None:
        if self._servicer is None:
            return
        status = self._status()
        for name in SERVICE_NAMES:
            await self._servicer.set(name, status)

    async def shutdown(self) -> None:
        if self._servicer is not None:
            await self._servicer.enter_graceful_shutdown()
