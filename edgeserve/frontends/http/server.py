"""The HTTP/REST frontend (KServe V2 + Triton extensions) on aiohttp."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from edgeserve.frontends.http.routes import HttpError, Routes, error_response
from edgeserve.protocol.errors import InferenceError

if TYPE_CHECKING:
    from edgeserve.config import Settings
    from edgeserve.server.dataplane import DataPlane

log = logging.getLogger("edgeserve.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes `{"error": "..."}` with Triton's status code; nothing escapes."""
    try:
        return await handler(request)
    except InferenceError as exc:
        if exc.http_status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.http_status, exc.message)
        return error_response(exc.http_status, exc.message)
    except HttpError as exc:
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
    except Exception as exc:  # a bug must not take the server down
        log.exception("%s %s failed with an internal error", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def build_app(dataplane: DataPlane, max_input_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_input_bytes, middlewares=[error_middleware])
    Routes(dataplane, max_input_bytes).register(app)
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
        self.app = build_app(dataplane, settings.http.max_input_bytes)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        # Decompression is ours (bounded by max_input_bytes); access logging costs too much per request.
        runner = web.AppRunner(
            self.app,
            access_log=None,
            auto_decompress=False,
            shutdown_timeout=self.settings.server.exit_timeout_s,
        )
        await runner.setup()
        try:
            if self.unix_path is not None:
                await web.UnixSite(runner, str(self.unix_path)).start()
                self.unix_path.chmod(0o600)
            if self.tcp:
                await web.TCPSite(runner, self.host, self.port, backlog=1024, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            where = f"{self.host}:{self.port}" if self.tcp else str(self.unix_path)
            raise RuntimeError(f"HTTP frontend cannot listen on {where}: {exc}") from exc
        self._runner = runner
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break
        if self.tcp:
            log.info("http frontend listening on http://%s:%d", self.host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `grace_s`, then close."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        runner._shutdown_timeout = grace_s
        await runner.cleanup()
        log.info("http frontend stopped")
