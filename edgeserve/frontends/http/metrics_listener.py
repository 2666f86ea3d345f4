"""Triton's metrics port (8002): the HTTP port's `/metrics` page, alone on its own listener.

Prometheus scrapers and Triton's own example clients dial `http://host:8002/metrics`. This listener
serves that one page, GET only, with the HTTP port's handler and access rules (`[http] token` for a
non-loopback peer), so it is never a way around them. It binds `[metrics] address` (loopback unless
set), is off with `[metrics] port = 0`, and bounds what a peer can make it hold: request lines and
headers of a few KB, no body, few connections (a stalled one is closed after `[http]
header_timeout_s`). A port already in use is logged and the server serves on without it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web

from edgeserve.frontends import access
from edgeserve.frontends.http import security
from edgeserve.frontends.http.routes import Routes
from edgeserve.frontends.http.server import (
    GUARD_KEY,
    POLICY_KEY,
    ConnectionGuard,
    _GuardedSite,
    error_middleware,
)

if TYPE_CHECKING:
    from edgeserve.config import Settings
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.metrics")

MAX_CONNECTIONS = 16  # scrapers hold one keep-alive connection each; a few more for people and scripts
MAX_CONNECTIONS_PER_CLIENT = 4
MAX_LINE_BYTES = 2048  # the request line and each header line
MAX_HEADERS = 32


def build_metrics_app(dataplane: DataPlane, policy: access.AccessPolicy) -> web.Application:
    """GET /metrics and nothing else (no body is ever read: client_max_size is the smallest aiohttp takes)."""
    app = web.Application(client_max_size=1, middlewares=[error_middleware])
    routes = Routes(dataplane, max_input_bytes=1)
    app.router.add_get("/metrics", routes.metrics, allow_head=False)
    security.check_routes(app)  # the handler is the HTTP port's, with its access endpoint
    app[POLICY_KEY] = policy
    return app


class MetricsFrontend:
    name = "metrics"

    def __init__(self, dataplane: DataPlane, settings: Settings) -> None:
        self.settings = settings
        self.host = settings.metrics.address
        self.port = settings.metrics.port  # the bound port once started
        self.app = build_metrics_app(dataplane, access.AccessPolicy.from_settings("http", settings.http))
        self.guard = ConnectionGuard(
            MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT, settings.http.header_timeout_s
        )
        self.app[GUARD_KEY] = self.guard
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        if self.port == 0:
            return
        runner = web.AppRunner(
            self.app,
            access_log=None,
            shutdown_timeout=1.0,  # a scrape is short; nothing worth draining for
            keepalive_timeout=self.settings.http.keepalive_timeout_s,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_LINE_BYTES,
            max_headers=MAX_HEADERS,
        )
        await runner.setup()
        try:
            await _GuardedSite(runner, self.guard, self.host, self.port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            log.error("metrics listener cannot listen on %s:%d ([metrics] port, address): %s; /metrics is "
                      "still on the HTTP port", self.host, self.port, exc)  # fmt: skip
            return
        self._runner = runner
        self.guard.start()
        if not access.is_loopback_bind(self.host):
            token = "" if self.settings.http.token else ", no [http] token: anyone on the network reads it"
            log.warning("metrics listener on %s: plain HTTP beyond loopback%s", self.host, token)
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        log.info("metrics listener on http://%s:%d/metrics", self.host, self.port)

    async def stop(self, grace_s: float) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.guard.stop()
        await runner.cleanup()
        log.info("metrics listener stopped")
