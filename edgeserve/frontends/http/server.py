"""The HTTP/REST frontend (KServe V2 + Triton extensions) on aiohttp.

Connection bounds (`ConnectionGuard`, wrapped around aiohttp's protocol): at most
`[http] max_connections` open connections and `max_connections_per_client` per peer address (more
are answered 503 and closed at once); a request whose headers, or whose started body, stall longer
than `header_timeout_s` is closed (slowloris); an idle keep-alive connection is closed after
`keepalive_timeout_s`. The request body limit is `max_input_bytes` (frontends/limits.py).

Access (frontends/access.py, as gRPC): `[http] token` for non-loopback peers, admin endpoints from
loopback only, Triton's restricted APIs; HTTPS with `tls_cert`/`tls_key` (+ `tls_client_ca`: mutual TLS).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from edgeserve.frontends import access
from edgeserve.frontends.http import security
from edgeserve.frontends.http.routes import HttpError, Routes, error_response
from edgeserve.frontends.limits import request_limit
from edgeserve.private_socket import unix_listener
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import client_scope

if TYPE_CHECKING:
    from edgeserve.config import Settings
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.http")


class _ClientGarbage(logging.Filter):
    """aiohttp logs a malformed request or a client that hangs up at ERROR with a traceback; it is
    the client's doing (it got its 400, or left): one DEBUG line, so garbage cannot flood the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (HttpProcessingError, ConnectionResetError)):
            if not log.isEnabledFor(logging.DEBUG):
                return False
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}".replace("\n", " ")
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


logging.getLogger("aiohttp.server").addFilter(_ClientGarbage())

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes `{"error": "..."}` with Triton's status code; nothing escapes."""
    guard: ConnectionGuard | None = request.app.get(GUARD_KEY)
    conn = guard.begin(request) if guard is not None else None
    try:
        security.check(request.app[POLICY_KEY], request)
        with client_scope(request.remote or ""):
            return await handler(request)
    except InferenceError as exc:
        if exc.http_status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.http_status, exc.message)
        response = error_response(exc.http_status, exc.message)
        if exc.status is Status.UNAUTHENTICATED:
            response.headers.update(security.CHALLENGE)
        return response
    except HttpError as exc:
        if exc.status == 413:
            return error_response(413, f"{exc.message} ([http] max_input_bytes)")
        return error_response(exc.status, exc.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = "Not Found"
        elif exc.status == 405:
            message = f"Method Not Allowed: {request.method} {request.path}"
        elif exc.status == 413:
            message = exc.text or "request body too large"
        else:
            message = exc.reason
        response = error_response(exc.status, message)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client hung up mid-request: nobody to answer, nothing of ours broke
        log.debug("%s %s: the client closed the connection", request.method, request.path)
        raise
    except Exception as exc:  # a bug must not take the server down
        log.exception("%s %s failed with an internal error", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
    finally:
        if conn is not None:
            conn.end()


_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b'Content-Length: %d\r\n\r\n{"error":"%s"}'
)


def _refusal(message: str) -> bytes:
    body_len = len(message) + len('{"error":""}')
    return _REFUSED % (body_len, message.encode())


class _Conn(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard's bookkeeping around it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.admitted = False
        self.request: web.BaseRequest | None = None
        self.pending_since = 0.0  # first byte of a request not yet handed to a handler (0 = none)
        self.last_data = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "unix"
        refusal = self.guard.admit(self)
        if refusal is not None:
            transport.write(_refusal(refusal))
            transport.close()
            return
        self.admitted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        now = time.monotonic()
        self.last_data = now
        if self.request is None and not self.pending_since:
            self.pending_since = now
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.admitted:
            self.admitted = False
            self.guard.release(self)
            self.inner.connection_lost(exc if isinstance(exc, Exception) or exc is None else None)

    def end(self) -> None:
        """The request's handler finished: the next request's headers are timed from their first byte."""
        self.request = None
        self.pending_since = 0.0


class ConnectionGuard:
    def __init__(self, max_total: int, max_per_client: int, stall_timeout_s: float) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.stall_timeout_s = stall_timeout_s
        self.conns: set[_Conn] = set()
        self.per_client: dict[str, int] = {}
        self.by_transport: dict[int, _Conn] = {}
        self.refused = 0
        self.stalled = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def wrap(self, factory: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Conn(self, factory())

    def admit(self, conn: _Conn) -> str | None:
        if len(self.conns) >= self.max_total:
            self.refused += 1
            return f"too many connections (max {self.max_total}, [http] max_connections)"
        # Local processes (camera pipelines, scripts) share 127.0.0.1: only the total bounds them.
        local = conn.client in ("", "unix") or access.is_loopback_address(conn.client)
        if not local and self.per_client.get(conn.client, 0) >= self.max_per_client:
            self.refused += 1
            return (
                f"too many connections from {conn.client} "
                f"(max {self.max_per_client}, [http] max_connections_per_client)"
            )
        self.conns.add(conn)
        self.per_client[conn.client] = self.per_client.get(conn.client, 0) + 1
        assert conn.transport is not None
        self.by_transport[id(conn.transport)] = conn
        return None

    def release(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if conn.transport is not None:
            self.by_transport.pop(id(conn.transport), None)
        left = self.per_client.get(conn.client, 0) - 1
        if left > 0:
            self.per_client[conn.client] = left
        else:
            self.per_client.pop(conn.client, None)

    def begin(self, request: web.Request) -> _Conn | None:
        transport = request.transport
        conn = self.by_transport.get(id(transport)) if transport is not None else None
        if conn is not None:
            conn.request = request
            conn.pending_since = 0.0
        return conn

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(1.0, self._sweep)

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep(self) -> None:
        now = time.monotonic()
        limit = self.stall_timeout_s
        for conn in list(self.conns):
            request = conn.request
            if request is None:
                stalled = bool(conn.pending_since) and now - conn.pending_since > limit
            else:  # a body still arriving, with nothing received for too long
                stalled = not request.content.is_eof() and now - conn.last_data > limit
            if stalled and conn.transport is not None:
                self.stalled += 1
                log.info("http: closing a stalled connection from %s (nothing for %.0f s)",
                         conn.client, limit)  # fmt: skip
                conn.transport.abort()
        self._sweeper = asyncio.get_running_loop().call_later(min(1.0, limit / 2), self._sweep)


GUARD_KEY: web.AppKey[ConnectionGuard] = web.AppKey("edgeserve_connection_guard", ConnectionGuard)


ROUTES_KEY: web.AppKey[Routes] = web.AppKey("edgeserve_routes", Routes)
POLICY_KEY: web.AppKey[access.AccessPolicy] = web.AppKey("edgeserve_access", access.AccessPolicy)


def build_app(
    dataplane: DataPlane, max_input_bytes: int, policy: access.AccessPolicy | None = None
) -> web.Application:
    """`policy`: who may call what (None = open, as tests of the routes alone want it)."""
    app = web.Application(client_max_size=max_input_bytes, middlewares=[error_middleware])
    routes = Routes(dataplane, max_input_bytes)
    routes.register(app)
    security.check_routes(app)
    app[ROUTES_KEY] = routes
    app[POLICY_KEY] = policy or access.AccessPolicy("http", admin_loopback_only=False)
    return app


class HttpFrontend:
    name = "http"

    def __init__(self, dataplane: DataPlane, settings: Settings, unix_path: Path | None = None) -> None:
        self.dataplane = dataplane
        self.tcp = settings.http.enabled
        # The supervisor's private door to the same API (works with HTTP off or on port 0).
        self.unix_path = unix_path
        self.settings = settings
        self.host = settings.http.host
        self.port = settings.http.port  # the bound port once started (port 0 picks a free one)
        self.max_input_bytes = request_limit(settings.http.max_input_bytes, settings)
        http = settings.http
        self.app = build_app(dataplane, self.max_input_bytes, access.AccessPolicy.from_settings("http", http))
        self.guard = ConnectionGuard(
            http.max_connections, http.max_connections_per_client, http.header_timeout_s
        )
        self.app[GUARD_KEY] = self.guard
        self.apply_limits(settings)
        self._runner: web.AppRunner | None = None

    def apply_limits(self, settings: Settings) -> None:
        """At start and on SIGHUP."""
        self.app[ROUTES_KEY].inline_max_ns = max(0, settings.http.inline_max_us) * 1000

    async def start(self) -> None:
        # Decompression is ours (bounded by max_input_bytes); access logging costs too much per request.
        runner = web.AppRunner(
            self.app,
            access_log=None,
            auto_decompress=False,
            shutdown_timeout=self.settings.server.exit_timeout_s,
            keepalive_timeout=self.settings.http.keepalive_timeout_s,
        )
        await runner.setup()
        http = self.settings.http
        try:
            if self.unix_path is not None:  # 0600 from birth: no chmod window for a group member
                await web.SockSite(runner, unix_listener(self.unix_path, 0o600)).start()
            if self.tcp:
                tls = security.ssl_context(http)
                for warning in access.exposure_warnings(
                    "http", self.host, http.token, tls is not None, bool(http.tls_client_ca)
                ):
                    log.warning("%s", warning)
                site = _GuardedSite(runner, self.guard, self.host, self.port, backlog=1024,
                                    reuse_address=True, ssl_context=tls)  # fmt: skip
                await site.start()
        except OSError as exc:
            await runner.cleanup()
            where = f"{self.host}:{self.port}" if self.tcp else str(self.unix_path)
            raise RuntimeError(f"HTTP frontend cannot listen on {where}: {exc}") from exc
        self._runner = runner
        self.guard.start()
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        if self.tcp:
            scheme = "https" if http.tls_cert else "http"
            log.info("http frontend listening on %s://%s:%d", scheme, self.host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `grace_s`, then close."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.guard.stop()
        runner._shutdown_timeout = grace_s
        await runner.cleanup()
        log.info("http frontend stopped")


class _GuardedSite(web.TCPSite):
    """TCPSite whose connections go through the guard (aiohttp's protocol wrapped, not replaced)."""

    def __init__(self, runner: web.AppRunner, guard: ConnectionGuard, *args: Any, **kwargs: Any) -> None:
        super().__init__(runner, *args, **kwargs)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # TCPSite.start, with the guard around the protocol factory
        server = self._runner.server
        assert server is not None
        # A TLS handshake that stalls is bounded like stalled headers (the guard sees it only after).
        handshake_s = self._guard.stall_timeout_s if self._ssl_context else None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.wrap(server), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            ssl_handshake_timeout=handshake_s,
        )  # fmt: skip
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
