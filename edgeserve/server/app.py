"""Wires settings -> shm registry -> repository -> data plane -> frontends, and owns their lifetimes."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

from edgeserve.config import Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.server")


class StartupError(Exception):
    """The server cannot start (a port in use, a bad certificate...): one line for the operator."""


class Frontend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class Server:
    def __init__(self, settings: Settings) -> None:
        from edgeserve.hardware.selector import PlanSelector
        from edgeserve.repository.manager import ModelRepository

        self.settings = settings
        self.shm = SharedMemoryRegistry(
            settings.shm.allow_client_shm, settings.shm.key_prefixes, settings.shm.max_regions
        )
        self.repository = ModelRepository(settings, selector=PlanSelector(settings))
        self.dataplane = DataPlane(
            self.repository,
            self.shm,
            strict_readiness=settings.server.strict_readiness,
            model_control_mode=settings.server.model_control_mode,
        )
        self.frontends: list[Frontend] = []
        self._stopped = asyncio.Event()

    def _build_frontends(self) -> list[Frontend]:
        frontends: list[Frontend] = []
        if self.settings.http.enabled:
            from edgeserve.frontends.http.server import HttpFrontend

            frontends.append(HttpFrontend(self.dataplane, self.settings))
        if self.settings.grpc.enabled:
            try:
                from edgeserve.frontends.grpc.server import GrpcFrontend
            except ImportError as exc:  # until the gRPC frontend lands, or grpcio is missing
                log.warning("grpc frontend unavailable: %s", exc)
            else:
                frontends.append(GrpcFrontend(self.dataplane, self.settings))
        if self.settings.zmq.enabled:
            try:
                from edgeserve.frontends.zmq.server import ZmqFrontend
            except ImportError as exc:
                log.warning("zmq frontend unavailable: %s", exc)
            else:
                frontends.append(ZmqFrontend(self.dataplane, self.settings))
        return frontends

    async def start(self) -> None:
        """Frontends first (live answers, ready is false), then the models (ready once all warmed up)."""
        repository = self.settings.server.model_repository
        if not repository.is_dir():
            raise StartupError(
                f"model repository {repository} is not a folder; set --model-repository or "
                "[server] model_repository (run `edgeserve samples` for the sample models)"
            )
        self.frontends = self._build_frontends()
        for frontend in self.frontends:
            try:
                await frontend.start()
            except Exception as exc:
                raise StartupError(f"{frontend.name} frontend: {exc}") from exc
        await self.repository.start()
        log.info("server ready=%s models=%d", self.dataplane.ready(), len(self.repository.served()))

    async def stop(self) -> None:
        grace = self.settings.server.exit_timeout_s
        log.info("shutting down: draining for up to %.0fs", grace)
        self.dataplane.shutting_down = True
        await asyncio.gather(*(f.stop(grace) for f in self.frontends), return_exceptions=True)
        await self.repository.close()
        self.shm.close()
        self._stopped.set()
        log.info("shutdown complete")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        try:
            await self.start()
            await stop_requested.wait()
        finally:
            await self.stop()
