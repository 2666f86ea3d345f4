"""A real aiohttp file server on loopback, in a background thread with its own event loop, with per-URL
fault injection, for download tests that are synchronous.

    server = BundleServer().start()
    url = server.add("/b.tar", data, drop_after=1_000_000, times=1)
    ... download(url, ...) ...
    server.requests("/b.tar")  # every request: method, path, Range, If-Range, status
    server.stop()

Files are served with Range support (one range: 206 + Content-Range; 416 past the end), a strong ETag and
Last-Modified, honouring If-Range. Faults (all per path):

- ``drop_after=N``: send N bytes of body, then close the connection;
- ``stall_after=N, stall_s=S``: send N bytes, then sleep S seconds (woken early by stop()), then go on;
- ``corrupt=True``: serve bytes that differ from the registered ones (same length, same ETag);
- ``ignore_range=True``: always 200 with the full body; ``ignore_if_range=True``: honour Range even when
  If-Range no longer matches (a naive server);
- ``chunked=True``: no Content-Length (chunked transfer encoding);
- ``status=S``: answer S (with a short text body and ``extra_headers``: ``status=302,
  extra_headers={"Location": url}`` redirects); with ``fail_first=K`` only the first K requests (then
  serve normally); ``fail_first=K`` alone means status 500.

``times=K`` limits drop/stall/corrupt/ignore_range/chunked to the first K requests for that path (None:
every request). ``BundleServer(ssl_context=...)`` serves https instead; ``BundleServer(host=...)`` listens on
another address than 127.0.0.1 (a LAN address of this machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

from aiohttp import web

WRITE_CHUNK = 64 * 1024
MAX_STALL_S = 30.0


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    if_range: str | None
    status: int


@dataclass
class Entry:
    data: bytes
    etag: str
    last_modified: str
    drop_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0
    corrupt: bool = False
    ignore_range: bool = False
    ignore_if_range: bool = False
    chunked: bool = False
    status: int | None = None
    fail_first: int | None = None
    times: int | None = None
    served: int = 0  # requests seen for this path
    extra_headers: dict[str, str] = field(default_factory=dict)


def _parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """(start, end inclusive), None (ignore the header), or "unsatisfiable"."""
    value = value.strip()
    if not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[len("bytes=") :].partition("-")
    try:
        if first == "":
            suffix = int(last)
            if suffix <= 0:
                return "unsatisfiable"
            return max(0, size - suffix), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return "unsatisfiable"
    return start, min(end, size - 1)


class BundleServer:
    def __init__(self, ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> None:
        self._ssl_context = ssl_context  # serve https with it
        self.host = host
        self._entries: dict[str, Entry] = {}
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self.port = 0

    # --- test-facing API ---------------------------------------------------------------------------

    def add(self, path: str, content: bytes | Path, **faults: object) -> str:
        """Register (or replace) the file served at `path`; returns its URL. The ETag derives from the bytes;
        the request counter (for `times`/`fail_first`) starts again at 0."""
        if not path.startswith("/"):
            path = "/" + path
        data = content.read_bytes() if isinstance(content, Path) else bytes(content)
        with self._lock:
            etag = f'"{hashlib.sha256(data).hexdigest()[:32]}"'  # content-derived: same bytes, same ETag
            entry = Entry(data=data, etag=etag, last_modified=formatdate(time.time(), usegmt=True))
            for key, value in faults.items():
                if not hasattr(entry, key) or key in ("data", "etag", "last_modified", "served"):
                    raise TypeError(f"unknown fault {key!r}")
                setattr(entry, key, value)
            if entry.stall_s > MAX_STALL_S:
                raise ValueError(f"stall_s is bounded to {MAX_STALL_S}")
            self._entries[path] = entry
        return self.url(path)

    def etag(self, path: str) -> str:
        with self._lock:
            return self._entries[path if path.startswith("/") else "/" + path].etag

    def url(self, path: str) -> str:
        if not path.startswith("/"):
            path = "/" + path
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}{path}"

    def requests(self, path: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self._requests if path is None or r.path == path]

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> BundleServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._setup(sock))
            except BaseException as exc:  # reported to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._teardown())
                loop.close()

        self._thread = threading.Thread(target=run, name="bundle-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("bundle server did not start")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._request_stop)
        thread.join(15)
        self._thread = None

    def __enter__(self) -> BundleServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inside the loop -----------------------------------------------------------------------------

    async def _setup(self, sock: socket.socket) -> None:
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self._ssl_context).start()

    def _request_stop(self) -> None:
        assert self._stopping is not None and self._loop is not None
        self._stopping.set()  # wakes stalled handlers
        self._loop.stop()

    async def _teardown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _record(self, request: web.Request, status: int) -> None:
        with self._lock:
            self._requests.append(
                Request(
                    request.method,
                    request.path,
                    request.headers.get("Range"),
                    request.headers.get("If-Range"),
                    status,
                )
            )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            entry = self._entries.get(request.path)
            if entry is not None:
                entry.served += 1
                nth = entry.served
        if entry is None:
            self._record(request, 404)
            return web.Response(status=404, text="no such file\n")
        if request.method not in ("GET", "HEAD"):
            self._record(request, 405)
            return web.Response(status=405)
        failing = entry.status is not None or entry.fail_first is not None
        if failing and (entry.fail_first is None or nth <= entry.fail_first):
            status = entry.status if entry.status is not None else 500
            self._record(request, status)
            return web.Response(status=status, text=f"injected {status}\n", headers=entry.extra_headers)
        faulty = entry.times is None or nth <= entry.times

        data = entry.data
        if entry.corrupt and faulty:
            data = bytes(b ^ 0x5A for b in data[:4096]) + data[4096:]
        size = len(data)
        headers = {
            "ETag": entry.etag,
            "Last-Modified": entry.last_modified,
            "Accept-Ranges": "bytes",
            **entry.extra_headers,
        }
        status, start, end = 200, 0, size - 1
        range_header = request.headers.get("Range")
        if range_header is not None and not (entry.ignore_range and faulty):
            if_range = request.headers.get("If-Range")
            validators_match = if_range is None or if_range in (entry.etag, entry.last_modified)
            if validators_match or entry.ignore_if_range:
                parsed = _parse_range(range_header, size)
                if parsed == "unsatisfiable":
                    self._record(request, 416)
                    return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"})
                if isinstance(parsed, tuple):
                    status, (start, end) = 206, parsed
                    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = data[start : end + 1]
        self._record(request, status)

        response = web.StreamResponse(status=status, headers=headers)
        if entry.chunked and faulty:
            response.enable_chunked_encoding()
        else:
            response.content_length = len(body)
        await response.prepare(request)
        if request.method == "HEAD":
            return response

        drop_after = entry.drop_after if faulty else None
        stall_after = entry.stall_after if faulty else None
        sent = 0
        try:
            while sent < len(body):
                if drop_after is not None and sent >= drop_after:
                    await self._drop(request)
                    return response
                if stall_after is not None and sent >= stall_after:
                    await self._stall(entry.stall_s)
                    stall_after = None
                    continue
                limit = min(sent + WRITE_CHUNK, len(body))
                for cut in (drop_after, stall_after):
                    if cut is not None and cut > sent:
                        limit = min(limit, cut)
                await response.write(body[sent:limit])
                sent = limit
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        return response

    async def _stall(self, seconds: float) -> None:
        assert self._stopping is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), min(seconds, MAX_STALL_S))

    @staticmethod
    async def _drop(request: web.Request) -> None:
        transport = request.transport
        if transport is not None:
            transport.close()  # flushes what was written, then FIN: a short body
        await asyncio.sleep(0)
