"""Resumable bundle download: http(s) with Range/If-Range, retries, stall detection, and a full re-hash.

Standard library only: this runs inside the supervisor, which must stay small (no numpy/grpc/aiohttp).

The file is written to ``<dest>.part`` next to ``dest``; a small JSON sidecar ``<dest>.part.meta`` remembers
the URL, the server's validators (ETag / Last-Modified) and the expected total, so a later run (even after
the process was SIGKILLed) resumes with ``Range``/``If-Range`` and never splices a changed file onto an old
prefix. When the transfer is complete the whole file is hashed again from disk, compared with
``expected_sha256`` when given, and renamed onto ``dest`` atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import random
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["DownloadError", "Progress", "download"]

Progress = Callable[[int, int | None], None]  # (bytes so far, total or None)

CHUNK = 64 * 1024
FSYNC_EVERY = 8 * 1024 * 1024
PROGRESS_INTERVAL_S = 0.1
MAX_BACKOFF_S = 60.0
USER_AGENT = "edgeserve-ota/1"

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)\s*/\s*(\d+|\*)\s*$", re.IGNORECASE)


class DownloadError(Exception):
    """The download failed or was refused; the message is one line for an operator."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class _Retry(Exception):
    """A transient failure: try again (after a backoff), resuming from what is on disk."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Cancelled(Exception):
    pass


@dataclass
class _Meta:
    url: str
    etag: str | None = None
    last_modified: str | None = None
    total: int | None = None
    expected_sha256: str | None = None


def download(
    url: str,
    dest: Path,
    *,
    expected_sha256: str | None = None,
    max_bytes: int | None = None,
    progress: Progress | None = None,
    stall_timeout_s: float = 30.0,
    attempts: int = 5,
    backoff_s: float = 1.0,
    cancel: threading.Event | None = None,
    ca_file: Path | None = None,
) -> str:
    """Fetch `url` into `dest` (complete file) resumably; returns the sha256 hex of the whole file.

    `url` is http(s)://, file:// or a plain path. Transient failures (network errors, a dropped
    connection, 5xx/408/429, no byte for `stall_timeout_s`) are retried up to `attempts` tries in all
    with exponential backoff and jitter, resuming from the ``.part`` file; an attempt that grows the
    ``.part`` beyond anything seen before does not use up a try. Other 4xx fail at once. `cancel` is
    checked between attempts, while waiting, and between chunks; a cancelled download keeps its ``.part``.
    """
    dest = Path(dest)
    if expected_sha256 is not None:
        expected_sha256 = expected_sha256.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", expected_sha256):
            raise DownloadError(f"expected_sha256 is not a sha256 hex digest: {expected_sha256!r}")
    if attempts < 1:
        raise DownloadError(f"attempts must be at least 1, not {attempts}")
    part = dest.with_name(dest.name + ".part")
    meta_path = dest.with_name(dest.name + ".part.meta")
    reporter = _Reporter(progress)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create {dest.parent}: {exc}") from exc

    scheme = urllib.parse.urlsplit(url).scheme.lower()
    try:
        if scheme in ("http", "https"):
            _fetch_http(
                url, part, meta_path, expected_sha256, max_bytes, reporter, stall_timeout_s, attempts,
                backoff_s, cancel, ca_file,
            )  # fmt: skip
        elif scheme == "file" or "://" not in url:
            _copy_local(_local_path(url), part, meta_path, max_bytes, reporter, cancel)
        else:
            raise DownloadError(f"unsupported URL scheme {scheme!r}: {url}")
    except _Cancelled:
        raise DownloadError(f"download cancelled: {url}") from None

    digest = _sha256_file(part)
    if expected_sha256 is not None and digest != expected_sha256:
        _remove(part, meta_path)
        raise DownloadError(
            f"sha256 mismatch for {url}: expected {expected_sha256}, got {digest}; partial file deleted"
        )
    try:
        os.replace(part, dest)
        _fsync_dir(dest.parent)
    except OSError as exc:
        raise DownloadError(f"cannot move the download into place at {dest}: {exc}") from exc
    _remove(meta_path)
    size = _size(dest)
    reporter(size, size, final=True)
    return digest


# --- http(s) -------------------------------------------------------------------------------------------


def _fetch_http(
    url: str,
    part: Path,
    meta_path: Path,
    expected_sha256: str | None,
    max_bytes: int | None,
    reporter: _Reporter,
    stall_timeout_s: float,
    attempts: int,
    backoff_s: float,
    cancel: threading.Event | None,
    ca_file: Path | None,
) -> None:
    opener = _opener(url, ca_file)
    failures = 0
    restarted_416 = False
    best_size = _size(part)
    while True:
        _check_cancel(cancel)
        try:
            _attempt(
                opener, url, part, meta_path, expected_sha256, max_bytes, reporter, stall_timeout_s, cancel
            )
            return
        except _Restart416:
            if restarted_416:
                raise DownloadError(f"server keeps answering 416 (range not satisfiable) for {url}") from None
            restarted_416 = True
            _remove(part, meta_path)
            continue
        except _Retry as exc:
            size = _size(part)
            if size > best_size:  # progress: this try is not used up
                best_size = size
                failures = 0
            failures += 1
            if failures >= attempts:
                raise DownloadError(f"download failed after {attempts} attempts: {exc} ({url})") from None
            delay = min(MAX_BACKOFF_S, backoff_s * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)
            if exc.retry_after is not None:
                delay = max(delay, min(exc.retry_after, MAX_BACKOFF_S))
            if cancel is not None:
                if cancel.wait(delay):
                    raise _Cancelled() from None
            else:
                time.sleep(delay)


class _Restart416(Exception):
    pass


def _opener(url: str, ca_file: Path | None) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = []
    if urllib.parse.urlsplit(url).scheme.lower() == "https" or ca_file is not None:
        try:
            context = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise DownloadError(f"cannot load CA file {ca_file}: {exc}") from exc
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def _attempt(
    opener: urllib.request.OpenerDirector,
    url: str,
    part: Path,
    meta_path: Path,
    expected_sha256: str | None,
    max_bytes: int | None,
    reporter: _Reporter,
    stall_timeout_s: float,
    cancel: threading.Event | None,
) -> None:
    meta = _load_meta(meta_path)
    offset = _size(part)
    resumable = (
        offset > 0
        and meta is not None
        and meta.url == url
        # a .part for another bundle at the same URL; with no hash on one side the validators decide
        and (None in (meta.expected_sha256, expected_sha256) or meta.expected_sha256 == expected_sha256)
    )
    if offset > 0 and not resumable:
        offset = 0  # a .part we know nothing about (or for another URL/bundle): start over
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if offset > 0 and meta is not None:
        headers["Range"] = f"bytes={offset}-"
        if meta.etag is not None and not meta.etag.startswith("W/"):
            headers["If-Range"] = meta.etag
        elif meta.last_modified is not None:
            headers["If-Range"] = meta.last_modified
    request = urllib.request.Request(url, headers=headers)
    try:
        response = opener.open(request, timeout=stall_timeout_s)
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            _http_error(exc, url, part, offset, meta)
        return  # 416 with a complete .part
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise DownloadError(f"TLS certificate rejected for {url}: {exc.reason}") from exc
        raise _Retry(f"cannot connect: {exc.reason}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise _Retry(_describe(exc)) from exc

    with contextlib.closing(response):
        status = response.status
        if status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range"), url)
            etag = response.headers.get("ETag")
            last_modified = response.headers.get("Last-Modified")
            changed = meta is None or (
                (meta.etag is not None and etag is not None and etag != meta.etag)
                or (meta.etag is None and meta.last_modified not in (None, last_modified))
                or (meta.total is not None and total is not None and total != meta.total)
            )
            if offset == 0 or start != offset or changed:
                # Not the continuation we asked for: the file changed, or an odd server. Start over.
                _remove(part, meta_path)
                raise _Retry("server sent a range that does not continue the partial file; starting over")
        elif status == 200:
            offset = 0
            total = _content_length(response)
            etag = response.headers.get("ETag")
            last_modified = response.headers.get("Last-Modified")
        else:
            raise _Retry(f"unexpected HTTP status {status}")

        if max_bytes is not None and total is not None and total > max_bytes:
            _remove(part, meta_path)
            raise DownloadError(f"refused {url}: {total} bytes is more than the limit of {max_bytes}")
        if status == 200:
            # Truncate first, then remember the new validators: a kill between the two must never leave
            # an old prefix next to new validators.
            _remove(meta_path)
            try:
                part.write_bytes(b"")
            except OSError as exc:
                raise DownloadError(f"cannot write {part}: {exc}") from exc
            _save_meta(meta_path, _Meta(url, etag, last_modified, total, expected_sha256))
        _receive(response, url, part, offset, total, max_bytes, reporter, cancel)


def _http_error(exc: urllib.error.HTTPError, url: str, part: Path, offset: int, meta: _Meta | None) -> None:
    code = exc.code
    if code == 416 and offset > 0:
        total: int | None = None
        match = _CONTENT_RANGE.match(exc.headers.get("Content-Range", "") or "")
        if match and match.group(3) != "*":
            total = int(match.group(3))
        expected_total = total if total is not None else (meta.total if meta is not None else None)
        if expected_total is not None and offset == expected_total:
            return  # the .part is already the whole file: verify it
        raise _Restart416()
    if code >= 500 or code in (408, 429):
        retry_after: float | None = None
        with contextlib.suppress(TypeError, ValueError):
            retry_after = float(exc.headers.get("Retry-After", ""))
        raise _Retry(f"HTTP {code} {exc.reason}", retry_after) from exc
    what = "not found" if code == 404 else str(exc.reason or "refused")
    raise DownloadError(f"HTTP {code} {what}: {url}") from exc


def _receive(
    response: http.client.HTTPResponse,
    url: str,
    part: Path,
    offset: int,
    total: int | None,
    max_bytes: int | None,
    reporter: _Reporter,
    cancel: threading.Event | None,
) -> None:
    received = offset
    try:
        out: BinaryIO = open(part, "ab", buffering=0)  # noqa: SIM115
    except OSError as exc:
        raise DownloadError(f"cannot write {part}: {exc}") from exc
    with out:
        unsynced = 0
        reporter(received, total)
        while True:
            if cancel is not None and cancel.is_set():
                _fsync(out, part)
                raise _Cancelled()
            try:
                chunk = response.read1(CHUNK)  # what has arrived: a kill loses nothing received
            except (OSError, http.client.HTTPException) as exc:
                _fsync(out, part)
                raise _Retry(_describe(exc)) from exc
            if not chunk:
                break
            if max_bytes is not None and received + len(chunk) > max_bytes:
                out.close()
                _remove(part, part.with_name(part.name + ".meta"))
                raise DownloadError(f"refused {url}: more than the limit of {max_bytes} bytes arrived")
            try:
                _write_all(out, chunk)
            except OSError as exc:
                raise DownloadError(f"cannot write {part}: {exc}") from exc
            received += len(chunk)
            unsynced += len(chunk)
            if unsynced >= FSYNC_EVERY:
                _fsync(out, part)
                unsynced = 0
            reporter(received, total)
        _fsync(out, part)
    if total is not None and received != total:
        raise _Retry(f"connection closed after {received} of {total} bytes")


# --- file:// and plain paths ---------------------------------------------------------------------------


def _local_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "file":
        return Path(url).expanduser()
    if parts.netloc not in ("", "localhost"):
        raise DownloadError(f"file URL with a remote host is not supported: {url}")
    return Path(urllib.request.url2pathname(parts.path))


def _copy_local(
    source: Path,
    part: Path,
    meta_path: Path,
    max_bytes: int | None,
    reporter: _Reporter,
    cancel: threading.Event | None,
) -> None:
    try:
        src = open(source, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise DownloadError(f"not found: {source}") from None
    except OSError as exc:
        raise DownloadError(f"cannot read {source}: {exc}") from exc
    with src:
        total = os.fstat(src.fileno()).st_size
        if max_bytes is not None and total > max_bytes:
            raise DownloadError(f"refused {source}: {total} bytes is more than the limit of {max_bytes}")
        _remove(meta_path)  # a local copy always starts from 0; it is fast
        received = 0
        try:
            with open(part, "wb") as out:
                reporter(0, total)
                while True:
                    _check_cancel(cancel)
                    chunk = src.read(1024 * 1024)
                    if not chunk:
                        break
                    received += len(chunk)
                    if max_bytes is not None and received > max_bytes:
                        raise DownloadError(f"refused {source}: more than the limit of {max_bytes} bytes")
                    out.write(chunk)
                    reporter(received, total)
                out.flush()
                os.fsync(out.fileno())
        except (DownloadError, _Cancelled):
            _remove(part)
            raise
        except OSError as exc:
            raise DownloadError(f"cannot copy {source} to {part}: {exc}") from exc


# --- helpers -------------------------------------------------------------------------------------------


class _Reporter:
    """Calls `progress` at most every PROGRESS_INTERVAL_S, plus once at the end."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.last = float("-inf")

    def __call__(self, done: int, total: int | None, *, final: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self.progress(done, total)


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise _Cancelled()


def _parse_content_range(value: str | None, url: str) -> tuple[int, int | None]:
    match = _CONTENT_RANGE.match(value or "")
    if not match or match.group(1) is None:
        raise _Retry(f"bad Content-Range {value!r} in a 206 answer")
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.headers.get("Content-Length")
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        return None
    return length if length >= 0 else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "stalled (no data before the timeout)"
    if isinstance(exc, http.client.IncompleteRead):
        return "connection closed mid-transfer"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _write_all(out: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = out.write(view)
        if written is None:  # pragma: no cover - only non-blocking files return None
            continue
        view = view[written:]


def _fsync(out: BinaryIO, part: Path) -> None:
    try:
        os.fsync(out.fileno())
    except OSError as exc:
        raise DownloadError(f"cannot write {part}: {exc}") from exc


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1024 * 1024):
                digest.update(chunk)
    except OSError as exc:
        raise DownloadError(f"cannot read back {path}: {exc}") from exc
    return digest.hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _load_meta(path: Path) -> _Meta | None:
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
        return None

    def text(key: str) -> str | None:
        value = raw.get(key)
        return value if isinstance(value, str) else None

    total = raw.get("total")
    return _Meta(
        url=raw["url"],
        etag=text("etag"),
        last_modified=text("last_modified"),
        total=total if isinstance(total, int) and not isinstance(total, bool) else None,
        expected_sha256=text("expected_sha256"),
    )


def _save_meta(path: Path, meta: _Meta) -> None:
    tmp = path.with_name(path.name + ".tmp")
    body = {
        "url": meta.url,
        "etag": meta.etag,
        "last_modified": meta.last_modified,
        "total": meta.total,
        "expected_sha256": meta.expected_sha256,
    }
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise DownloadError(f"cannot write {path}: {exc}") from exc
