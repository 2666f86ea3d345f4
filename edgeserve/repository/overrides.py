"""Model files sent with a load request (Triton's `file:<path>` parameters).

As in Triton, a load with files serves the model from a fresh folder holding only those files (and
the override config): `<state_dir>/overrides/<model>/<unique>/`, or a temporary folder when the
state folder is not writable. Each load gets its own folder, so a version still serving (and
draining) keeps its files until it is retired; `prune` removes the folders no longer in use. That
these files came with a request is carried by the load itself (origin.py), not by the folder.

Nothing here outlives the process that wrote it (a model loaded from files is not loaded again at the
next start), so `sweep` empties `<state_dir>/overrides/` at start: what a load killed half-way (or a
crash while serving) left behind goes. It holds a lock on the folder while the process lives, and
sweeps only when it gets it, so a second server on the same state folder never removes the files of
a live one. The checks before anything is written are in request_files.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from edgeserve.fsutil import PRIVATE_DIR, PRIVATE_FILE, private_mkdir
from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.layout import override_path

log = logging.getLogger("edgeserve.repository")

AREA = "overrides"
_LOCK = ".lock"
_held: dict[Path, int] = {}  # area -> descriptor of its lock, held until `release`
_tried: set[Path] = set()  # areas this process swept or found in use: never swept twice
_sweeping = threading.Lock()


def sweep(state_dir: Path) -> None:
    """At start, and before this process first writes there (a load may come before the repository's
    start): take the override area's lock and remove everything in it (earlier processes' files)."""
    root = state_dir / AREA
    with _sweeping:
        if root not in _tried:
            _tried.add(root)
            _sweep(root)


def _sweep(root: Path) -> None:
    try:
        private_mkdir(root)
        fd = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        log.warning("%s cannot be used (%s); load request files go to a temporary folder", root, exc)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        log.info("%s is in use by another edgeserve process; not cleaning it", root)
        return
    _held[root] = fd
    for entry in root.iterdir():
        if entry.name == _LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        log.info("removed %s, left by an earlier run", entry)


def release(state_dir: Path) -> None:
    """Give the area's lock back (the repository closed): a later start in this process may sweep."""
    with _sweeping:
        _tried.discard(state_dir / AREA)
        fd = _held.pop(state_dir / AREA, None)
    if fd is not None:
        os.close(fd)


def write_files(state_dir: Path, model: str, files: Mapping[str, bytes]) -> Path:
    """Write `files` ("1/model.onnx" or "file:1/model.onnx" -> content) into a fresh folder."""
    entries = []
    for key, data in files.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RepositoryError(
                f"load file '{key}'", "content", f"must be bytes, got {type(data).__name__}"
            )
        entries.append((override_path(key), bytes(data)))
    sweep(state_dir)
    unique = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    base = state_dir / AREA / model
    try:
        target = private_mkdir(base) / unique
        target.mkdir(PRIVATE_DIR)  # owner-only whatever the umask: these files are loaded and served
    except OSError as exc:
        target = Path(tempfile.mkdtemp(prefix=f"edgeserve-{model}-"))
        log.warning("model %s: %s is not writable (%s); load files go to %s", model, base, exc, target)
    try:
        for relative, data in entries:
            path = target.joinpath(*relative.parts)
            private_mkdir(path.parent)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
    except (OSError, ValueError) as exc:  # ValueError: a name the file system refuses (request_files checks)
        remove(target)
        raise RepositoryError(str(target), "", f"cannot write the load request's files: {exc}") from None
    return target


def remove(path: Path) -> None:
    """Remove a load's folder, and its model's folder in the area once that is empty."""
    shutil.rmtree(path, ignore_errors=True)
    if path.parent.parent.name == AREA:
        with contextlib.suppress(OSError):  # another load of the model still has its folder there
            path.parent.rmdir()


def prune(created: Iterable[Path], in_use: Iterable[Path]) -> list[Path]:
    """Remove the created folders not in use; returns the ones kept."""
    keep = {p.resolve() for p in in_use}
    kept: list[Path] = []
    for path in created:
        if path.resolve() in keep:
            kept.append(path)
        else:
            remove(path)
    return kept
