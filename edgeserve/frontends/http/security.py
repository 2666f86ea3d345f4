"""The HTTP side of frontends/access.py: what each route does, who is calling, the TLS context.

Every route's handler must have an entry in ENDPOINTS (`check_routes` refuses to start otherwise), so a
new admin route cannot slip in unchecked.
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edgeserve.frontends import access
from edgeserve.frontends.access import AccessPolicy, Endpoint
from edgeserve.frontends.http.routes import Routes

if TYPE_CHECKING:
    from edgeserve.config import HttpSection

ENDPOINTS: dict[Any, Endpoint] = {
    Routes.live: access.SERVER_HEALTH,
    Routes.ready: access.SERVER_HEALTH,
    Routes.model_ready: access.MODEL_READY,
    Routes.server_metadata: access.METADATA,
    Routes.model_metadata: access.METADATA,
    Routes.model_config: access.MODEL_CONFIG,
    Routes.stats: access.STATISTICS,
    Routes.infer: access.INFERENCE,
    Routes.generate: access.INFERENCE,
    Routes.repository_index: access.REPOSITORY_INDEX,
    Routes.load: access.MODEL_CONTROL,
    Routes.unload: access.MODEL_CONTROL,
    Routes.shm_status: access.SHM_STATUS,
    Routes.shm_register: access.SHM_CONTROL,
    Routes.shm_unregister: access.SHM_CONTROL,
    Routes.get_logging: access.LOG_READ,
    Routes.update_logging: access.LOG_UPDATE,
    Routes.get_trace: access.TRACE,
    Routes.update_trace: access.TRACE,
    Routes.metrics: access.METRICS,
}
# RFC 6750: a 401 names the scheme the client should use.
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="edgeserve"'}


def endpoint_of(request: web.Request) -> Endpoint | None:
    """None for a request that matched no route (404/405): only the token applies to it."""
    return ENDPOINTS.get(getattr(request.match_info.handler, "__func__", None))


def check_routes(app: web.Application) -> None:
    for route in app.router.routes():
        handler = getattr(route.handler, "__func__", None)
        if handler not in ENDPOINTS:
            raise RuntimeError(f"HTTP route {route.method} {route.resource} has no access endpoint")


class HttpPeer:
    __slots__ = ("request",)

    def __init__(self, request: web.Request) -> None:
        self.request = request

    def private(self) -> bool:
        """The supervisor's control socket (Unix, mode 0600)."""
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        return sock is not None and sock.family == socket.AF_UNIX

    def loopback(self) -> bool:
        if self.private():
            return True
        transport = self.request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return isinstance(peer, (tuple, list)) and bool(peer) and access.is_loopback_address(str(peer[0]))

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)


def check(policy: AccessPolicy, request: web.Request) -> None:
    endpoint = endpoint_of(request)
    if policy.needs_check(endpoint):
        policy.check(endpoint, HttpPeer(request))


def ssl_context(settings: HttpSection) -> ssl.SSLContext | None:
    """HTTPS when tls_cert/tls_key are set; client certificates required when tls_client_ca is set."""
    if not settings.tls_cert or not settings.tls_key:
        return None
    # read first: a missing file is one clear line naming the setting
    access.read_tls_files("http", settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    # not create_default_context: it would trust the system's CAs for client certificates too
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
        if settings.tls_client_ca:
            context.load_verify_locations(cafile=str(settings.tls_client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        raise OSError(f"[http] tls_cert/tls_key/tls_client_ca: not usable PEM files: {exc}") from None
    return context
