"""The server process (`edgeserve serve`): wires settings -> shm registry -> repository -> data plane ->
frontends and owns their lifetimes; on SIGHUP it re-reads the settings and applies what can change
without dropping a request.

The supervisor decides (settings_tools.LIVE_SETTINGS) whether a change needs a restart; the server
applies the live part here, whether it runs under the supervisor or alone.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from edgeserve.backends.streams import install_caller
from edgeserve.config import ConfigError, Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.logs import set_level
from edgeserve.metrics import register_collector, unregister_collector
from edgeserve.protocol.errors import InferenceError
from edgeserve.scheduling.cache import MIB, ResponseCache
from edgeserve.server.bls import DataPlaneCaller
from edgeserve.server.dataplane import DataPlane
from edgeserve.settings_tools import changed_fields, is_live

log = logging.getLogger("edgeserve.server")


class StartupError(Exception):
    """The server cannot start (a port in use, a bad certificate...): one line for the operator."""


class Frontend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


class Server:
    def __init__(
        self,
        settings: Settings,
        reload_settings: Callable[[], Settings] | None = None,
        control_socket: Path | None = None,
    ) -> None:
        from edgeserve.hardware.selector import PlanSelector
        from edgeserve.repository.manager import ModelRepository

        self.settings = settings
        self.shm = SharedMemoryRegistry(
            settings.shm.allow_client_shm,
            settings.shm.key_prefixes,
            settings.shm.max_regions,
            settings.shm.registration,
        )
        self.repository = ModelRepository(settings, selector=PlanSelector(settings))
        self.response_cache = ResponseCache(settings.server.cache_mb * MIB)
        register_collector(self.response_cache.collector)
        self.dataplane = DataPlane(
            self.repository,
            self.shm,
            strict_readiness=settings.server.strict_readiness,
            model_control_mode=settings.server.model_control_mode,
            max_inflight=settings.server.max_inflight,
            response_cache=self.response_cache,
        )
        self.frontends: list[Frontend] = []
        self._stopped = asyncio.Event()
        self._reload_settings = reload_settings
        self._control_socket = control_socket
        self._reloads: set[asyncio.Task[None]] = set()
        self._reload_lock = asyncio.Lock()

    def _build_frontends(self) -> list[Frontend]:
        frontends: list[Frontend] = []
        if self.settings.http.enabled or self._control_socket is not None:
            from edgeserve.frontends.http.server import HttpFrontend

            frontends.append(HttpFrontend(self.dataplane, self.settings, unix_path=self._control_socket))
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
        if self.settings.metrics.port:  # Triton's metrics port (8002): /metrics alone
            from edgeserve.frontends.http.metrics_listener import MetricsFrontend

            frontends.append(MetricsFrontend(self.dataplane, self.settings))
        return frontends

    async def start(self) -> None:
        """Frontends first (live answers, ready is false), then the models (ready once all warmed up)."""
        from edgeserve.repository.layout import repository_problem

        problem = repository_problem(self.settings)
        clashes = self.repository.clashes()
        if problem is not None:
            raise StartupError(problem)
        if clashes:
            raise StartupError(next(iter(clashes.values())))
        self.frontends = self._build_frontends()
        for frontend in self.frontends:
            try:
                await frontend.start()
            except Exception as exc:
                raise StartupError(f"{frontend.name} frontend: {exc}") from exc
        attach = getattr(self.repository.selector, "attach", None)
        if attach is not None:  # background races (hardware/race_background.py) pause and switch here
            attach(self.repository, asyncio.get_running_loop())
        # BLS calls (Python models, also from initialize) reach the models through this data plane
        install_caller(DataPlaneCaller(self.dataplane))
        await self.repository.start()
        log.info("server ready=%s models=%d", self.dataplane.ready(), len(self.repository.served()))

    async def stop(self) -> None:
        grace = self.settings.server.exit_timeout_s
        log.info("shutting down: draining for up to %.0fs", grace)
        self.dataplane.shutting_down = True
        await asyncio.gather(*(f.stop(grace) for f in self.frontends), return_exceptions=True)
        close = getattr(self.repository.selector, "close", None)
        if close is not None:  # no background race may switch a model while it unloads
            await asyncio.to_thread(close)
        await self.repository.close()
        install_caller(None)
        self.shm.close()
        unregister_collector(self.response_cache.collector)
        self.response_cache.clear()
        self._stopped.set()
        log.info("shutdown complete")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        try:
            await self.start()
            await stop_requested.wait()
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            for task in list(self._reloads):
                task.cancel()
            await self.stop()

    def _on_sighup(self) -> None:
        if self._reload_settings is None:
            log.info("SIGHUP: no settings source to re-read")
            return
        task = asyncio.get_running_loop().create_task(self._reload())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self) -> None:
        assert self._reload_settings is not None
        async with self._reload_lock:
            await reload_settings(self, self._reload_settings)


# -- SIGHUP: the live settings ------------------------------------------------------------------------
def _startup_models(settings: Settings, everything: Callable[[], set[str]]) -> set[str]:
    server = settings.server
    if server.model_control_mode == "none" or "*" in server.load_models:
        return everything()
    return set(server.load_models)


async def reload_settings(server: Server, load: Callable[[], Settings]) -> list[str]:
    """Apply the live changes in place (every part holds the same Settings object); returns them."""
    try:
        new = load()
    except ConfigError as exc:
        log.error("reload refused, keeping the running settings: %s", exc)
        return []
    current = server.settings
    changed = changed_fields(current, new)
    later = [name for name in changed if not is_live(name)]
    if later:
        log.warning("reload: %s need a restart to take effect (the supervisor restarts for them)",
                    ", ".join(later))  # fmt: skip
    applied = [name for name in changed if is_live(name)]

    def everything() -> set[str]:
        return set(server.repository.folders())

    old_models = _startup_models(current, everything)
    current.logging.level = new.logging.level
    set_level(new.logging.level)
    current.server.exit_timeout_s = new.server.exit_timeout_s
    current.supervisor = new.supervisor
    shm = server.shm
    current.shm.allow_client_shm = shm.allow_client_shm = new.shm.allow_client_shm
    current.shm.key_prefixes = list(new.shm.key_prefixes)
    shm.key_prefixes = [p.lstrip("/") for p in new.shm.key_prefixes]
    current.shm.max_regions = shm.max_regions = new.shm.max_regions
    current.shm.registration = shm.registration = new.shm.registration
    current.zmq.max_inflight_per_client = new.zmq.max_inflight_per_client
    current.zmq.inline_max_us = new.zmq.inline_max_us
    current.http.inline_max_us = new.http.inline_max_us
    current.grpc.inline_max_us = new.grpc.inline_max_us
    for frontend in server.frontends:
        apply = getattr(frontend, "apply_limits", None)
        if apply is not None:
            apply(current)
    current.server.load_models = list(new.server.load_models)
    await _apply_model_list(server, old_models, _startup_models(current, everything))
    if applied:
        log.info("reload: applied live: %s", ", ".join(applied))
    else:
        log.info("reload: nothing to apply live")
    return applied


async def _apply_model_list(server: Server, old: set[str], new: set[str]) -> None:
    """Load what the list gained (and new folders under "*"), unload what it lost."""
    if server.settings.server.model_control_mode == "none" and old == new:
        return
    serving = {e["name"] for e in server.repository.index() if e.get("state") in ("READY", "LOADING")}
    on_demand = server.repository.budget.residency.on_demand  # loaded by their next request instead
    for name in sorted(n for n in new - serving if not on_demand(n)):
        try:
            await server.repository.load(name)
            log.info("reload: loaded %s", name)
        except InferenceError as exc:
            log.error("reload: cannot load %s: %s", name, exc.message)
    for name in sorted((old - new) & serving):
        try:
            await server.repository.unload(name)
            log.info("reload: unloaded %s", name)
        except InferenceError as exc:
            log.error("reload: cannot unload %s: %s", name, exc.message)
