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
import http.client
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
from typing import BinaryIO

from edgeserve.ota.download_files import (
    Cancelled,
    DownloadError,
    Meta,
    Progress,
    Reporter,
    check_cancel,
    copy_local,
    fsync,
    fsync_dir,
    load_meta,
    local_path,
    remove,
    save_meta,
    sha256_file,
    size,
    write_all,
    write_error,
)
from edgeserve.ota.url_policy import UrlPolicy, UrlRefused, check_url, checked_opener

__all__ = ["DownloadError", "Progress", "download"]

CHUNK = 64 * 1024
FSYNC_EVERY = 8 * 1024 * 1024
PROGRESS_INTERVAL_S = 0.1
MAX_BACKOFF_S = 60.0
USER_AGENT = "edgeserve-ota/1"

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)\s*/\s*(\d+|\*)\s*$", re.IGNORECASE)

# Before bytes are written: called with what is still to come (Content-Length minus what is on disk);
# it raises to refuse (the installer's statvfs preflight).
SpaceCheck = Callable[[int], None]


class _Retry(Exception):
    """A transient failure: try again (after a backoff), resuming from what is on disk."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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
    url_policy: UrlPolicy | None = None,
    space_check: SpaceCheck | None = None,
) -> str:
    """Fetch `url` into `dest` (complete file) resumably; returns the sha256 hex of the whole file.

    `url` is http(s)://, file:// or a plain path. Transient failures (network errors, a dropped
    connection, 5xx/408/429, no byte for `stall_timeout_s`) are retried up to `attempts` tries in all
    with exponential backoff and jitter, resuming from the ``.part`` file; an attempt that grows the
    ``.part`` beyond anything seen before does not use up a try. Other 4xx fail at once. `cancel` is
    checked between attempts, while waiting, and between chunks; a cancelled download keeps its ``.part``.
    With `url_policy` (fleet downloads, see url_policy.py) the URL, every redirect and every address
    connected to are checked, and no proxy is used. `space_check` sees the bytes still to come as soon
    as the server declares them, before any is written.
    """
    dest = Path(dest)
    if expected_sha256 is not None:
        expected_sha256 = expected_sha256.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", expected_sha256):
            raise DownloadError(f"expected_sha256 is not a sha256 hex digest: {expected_sha256!r}")
    if attempts < 1:
        raise DownloadError(f"attempts must be at least 1, not {attempts}")
    if url_policy is not None:
        try:
            check_url(url, url_policy)
        except UrlRefused as exc:
            raise DownloadError(str(exc), "url") from None
    part = dest.with_name(dest.name + ".part")
    meta_path = dest.with_name(dest.name + ".part.meta")
    reporter = Reporter(progress, PROGRESS_INTERVAL_S)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create {dest.parent}: {exc}") from exc

    scheme = urllib.parse.urlsplit(url).scheme.lower()
    try:
        if scheme in ("http", "https"):
            job = _Transfer(url, part, meta_path, expected_sha256, max_bytes, reporter, stall_timeout_s,
                            cancel, space_check, _opener(url, ca_file, url_policy))  # fmt: skip
            _fetch_http(job, attempts, backoff_s)
        elif scheme == "file" or "://" not in url:
            copy_local(local_path(url), part, meta_path, max_bytes, reporter, cancel)
        else:
            raise DownloadError(f"unsupported URL scheme {scheme!r}: {url}")
    except Cancelled:
        raise DownloadError(f"download cancelled: {url}") from None
    except UrlRefused as exc:  # at connect time, or a redirect
        raise DownloadError(str(exc), "url") from None

    digest = sha256_file(part)
    if expected_sha256 is not None and digest != expected_sha256:
        remove(part, meta_path)
        raise DownloadError(
            f"sha256 mismatch for {url}: expected {expected_sha256}, got {digest}; partial file deleted",
            "hash",
        )
    try:
        os.replace(part, dest)
        fsync_dir(dest.parent)
    except OSError as exc:
        raise DownloadError(f"cannot move the download into place at {dest}: {exc}") from exc
    remove(meta_path)
    done = size(dest)
    reporter(done, done, final=True)
    return digest


# --- http(s) -------------------------------------------------------------------------------------------


@dataclass
class _Transfer:
    url: str
    part: Path
    meta_path: Path
    expected_sha256: str | None
    max_bytes: int | None
    reporter: Reporter
    stall_timeout_s: float
    cancel: threading.Event | None
    space_check: SpaceCheck | None
    opener: urllib.request.OpenerDirector


def _fetch_http(job: _Transfer, attempts: int, backoff_s: float) -> None:
    failures = 0
    restarted_416 = False
    best_size = size(job.part)
    while True:
        check_cancel(job.cancel)
        try:
            _attempt(job)
            return
        except _Restart416:
            if restarted_416:
                raise DownloadError(
                    f"server keeps answering 416 (range not satisfiable) for {job.url}"
                ) from None
            restarted_416 = True
            remove(job.part, job.meta_path)
            continue
        except _Retry as exc:
            now = size(job.part)
            if now > best_size:  # progress: this try is not used up
                best_size = now
                failures = 0
            failures += 1
            if failures >= attempts:
                raise DownloadError(f"download failed after {attempts} attempts: {exc} ({job.url})") from None
            delay = min(MAX_BACKOFF_S, backoff_s * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)
            if exc.retry_after is not None:
                delay = max(delay, min(exc.retry_after, MAX_BACKOFF_S))
            if job.cancel is not None:
                if job.cancel.wait(delay):
                    raise Cancelled() from None
            else:
                time.sleep(delay)


class _Restart416(Exception):
    pass


def _opener(url: str, ca_file: Path | None, policy: UrlPolicy | None) -> urllib.request.OpenerDirector:
    context: ssl.SSLContext | None = None
    if urllib.parse.urlsplit(url).scheme.lower() == "https" or ca_file is not None:
        try:
            context = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise DownloadError(f"cannot load CA file {ca_file}: {exc}") from exc
    if policy is not None:
        return checked_opener(policy, context)
    handlers: list[urllib.request.BaseHandler] = []
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def _attempt(job: _Transfer) -> None:
    url, part, meta_path = job.url, job.part, job.meta_path
    meta = load_meta(meta_path)
    offset = size(part)
    resumable = (
        offset > 0
        and meta is not None
        and meta.url == url
        # a .part for another bundle at the same URL; with no hash on one side the validators decide
        and (
            None in (meta.expected_sha256, job.expected_sha256) or meta.expected_sha256 == job.expected_sha256
        )
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
        response = job.opener.open(request, timeout=job.stall_timeout_s)
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            _http_error(exc, url, offset, meta)
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
                remove(part, meta_path)
                raise _Retry("server sent a range that does not continue the partial file; starting over")
        elif status == 200:
            offset = 0
            total = _content_length(response)
            etag = response.headers.get("ETag")
            last_modified = response.headers.get("Last-Modified")
        else:
            raise _Retry(f"unexpected HTTP status {status}")

        if job.max_bytes is not None and total is not None and total > job.max_bytes:
            remove(part, meta_path)
            raise DownloadError(
                f"refused {url}: {total} bytes is more than the limit of {job.max_bytes}", "size"
            )
        if job.space_check is not None and total is not None:
            job.space_check(max(total - offset, 0))
        if status == 200:
            # Truncate first, then remember the new validators: a kill between the two must never leave
            # an old prefix next to new validators.
            remove(meta_path)
            try:
                part.write_bytes(b"")
            except OSError as exc:
                raise write_error(part, exc) from exc
            save_meta(meta_path, Meta(url, etag, last_modified, total, job.expected_sha256))
        _receive(job, response, offset, total)


def _http_error(exc: urllib.error.HTTPError, url: str, offset: int, meta: Meta | None) -> None:
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


def _receive(job: _Transfer, response: http.client.HTTPResponse, offset: int, total: int | None) -> None:
    part, max_bytes = job.part, job.max_bytes
    received = offset
    try:
        out: BinaryIO = open(part, "ab", buffering=0)  # noqa: SIM115
    except OSError as exc:
        raise write_error(part, exc) from exc
    with out:
        unsynced = 0
        job.reporter(received, total)
        while True:
            if job.cancel is not None and job.cancel.is_set():
                fsync(out, part)
                raise Cancelled()
            try:
                chunk = response.read1(CHUNK)  # what has arrived: a kill loses nothing received
            except (OSError, http.client.HTTPException) as exc:
                fsync(out, part)
                raise _Retry(_describe(exc)) from exc
            if not chunk:
                break
            if max_bytes is not None and received + len(chunk) > max_bytes:
                out.close()
                remove(part, job.meta_path)
                raise DownloadError(
                    f"refused {job.url}: more than the limit of {max_bytes} bytes arrived", "size"
                )
            try:
                write_all(out, chunk)
            except OSError as exc:
                raise write_error(part, exc) from exc
            received += len(chunk)
            unsynced += len(chunk)
            if unsynced >= FSYNC_EVERY:
                fsync(out, part)
                unsynced = 0
            job.reporter(received, total)
        fsync(out, part)
    if total is not None and received != total:
        raise _Retry(f"connection closed after {received} of {total} bytes")


# --- helpers -------------------------------------------------------------------------------------------


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
