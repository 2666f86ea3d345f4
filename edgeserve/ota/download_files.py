"""The download's files: the ``.part`` and its ``.part.meta`` sidecar, local copies (file:// and plain
paths), progress throttling, and the errors a download ends with."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

Progress = Callable[[int, int | None], None]  # (bytes so far, total or None)

PROGRESS_INTERVAL_S = 0.1
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DownloadError(Exception):
    """The download failed or was refused; the message is one line for an operator. `reason` says which
    kind: "hash", "size", "disk", "url" (refused by the URL policy) or "download" (the rest)."""

    def __init__(self, message: str, reason: str = "download") -> None:
        super().__init__(" ".join(message.split()))
        self.reason = reason


class Cancelled(Exception):
    pass


def write_error(path: Path, exc: OSError) -> DownloadError:
    if exc.errno in DISK_FULL:
        return DownloadError(f"disk full while writing {path}", "disk")
    return DownloadError(f"cannot write {path}: {exc}")


@dataclass
class Meta:
    url: str
    etag: str | None = None
    last_modified: str | None = None
    total: int | None = None
    expected_sha256: str | None = None


class Reporter:
    """Calls `progress` at most every PROGRESS_INTERVAL_S, plus once at the end."""

    def __init__(self, progress: Progress | None, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.progress = progress
        self.interval_s = interval_s
        self.last = float("-inf")

    def __call__(self, done: int, total: int | None, *, final: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if final or now - self.last >= self.interval_s:
            self.last = now
            self.progress(done, total)


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled()


# --- file:// and plain paths ---------------------------------------------------------------------------


def local_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "file":
        return Path(url).expanduser()
    if parts.netloc not in ("", "localhost"):
        raise DownloadError(f"file URL with a remote host is not supported: {url}")
    return Path(urllib.request.url2pathname(parts.path))


def copy_local(
    source: Path,
    part: Path,
    meta_path: Path,
    max_bytes: int | None,
    reporter: Reporter,
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
            raise DownloadError(
                f"refused {source}: {total} bytes is more than the limit of {max_bytes}", "size"
            )
        remove(meta_path)  # a local copy always starts from 0; it is fast
        received = 0
        try:
            with open(part, "wb") as out:
                reporter(0, total)
                while True:
                    check_cancel(cancel)
                    chunk = src.read(1024 * 1024)
                    if not chunk:
                        break
                    received += len(chunk)
                    if max_bytes is not None and received > max_bytes:
                        raise DownloadError(
                            f"refused {source}: more than the limit of {max_bytes} bytes", "size"
                        )
                    out.write(chunk)
                    reporter(received, total)
                out.flush()
                os.fsync(out.fileno())
        except (DownloadError, Cancelled):
            remove(part)
            raise
        except OSError as exc:
            remove(part)
            if exc.errno in DISK_FULL:
                raise write_error(part, exc) from exc
            raise DownloadError(f"cannot copy {source} to {part}: {exc}") from exc


# --- helpers -------------------------------------------------------------------------------------------


def write_all(out: BinaryIO, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = out.write(view)
        if written is None:  # pragma: no cover - only non-blocking files return None
            continue
        view = view[written:]


def fsync(out: BinaryIO, part: Path) -> None:
    try:
        os.fsync(out.fileno())
    except OSError as exc:
        raise write_error(part, exc) from exc


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1024 * 1024):
                digest.update(chunk)
    except OSError as exc:
        raise DownloadError(f"cannot read back {path}: {exc}") from exc
    return digest.hexdigest()


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def load_meta(path: Path) -> Meta | None:
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
    return Meta(
        url=raw["url"],
        etag=text("etag"),
        last_modified=text("last_modified"),
        total=total if isinstance(total, int) and not isinstance(total, bool) else None,
        expected_sha256=text("expected_sha256"),
    )


def save_meta(path: Path, meta: Meta) -> None:
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
        raise write_error(path, exc) from exc
