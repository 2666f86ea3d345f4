"""Sealed cache files: what edgeserve reads back from its cache folder is what edgeserve wrote there.

The cache folder (compiled OpenVINO models, TensorRT engines, race and accuracy results, INT8 work files)
sits in the state folder, where a member of the service group may be able to write. So every file we
read back has a seal beside it, `<name>.seal`, written by us at write time: its sha256, size, inode and
mtime. A file is used only when both it and its seal are regular files owned by edgeserve's user and
writable by no one else (nobody else can forge that ownership, and nobody else can then change their
bytes), the seal names the file, and the content matches the seal's digest; an unchanged (inode,
mtime_ns, size) skips the hash. Anything else is discarded with a warning naming the file, and the
caller rebuilds it: a cache costs time when it is lost, never a wrong or hostile load.

Readers get the verified bytes themselves, never a path to reopen, so nothing can be swapped between
the check and the use. For caches a runtime reads on its own (ONNX
Runtime's TensorRT / OpenVINO execution providers), `check_folder` runs before the runtime starts and
`seal_folder` after it wrote; there a swap in between is only kept out by the folder's modes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from edgeserve.fsutil import fsync_dir, sha256_fd, write_bytes_atomic

log = logging.getLogger("edgeserve.cache")

SEAL_SUFFIX = ".seal"
SEAL_FORMAT = "edgeserve seal v1"
_MAX_SEAL_BYTES = 4096
T = TypeVar("T")


class Rejected(Exception):
    """Why a cache file is not ours (the warning's text)."""


def seal_path(path: Path) -> Path:
    return path.with_name(path.name + SEAL_SUFFIX)


def why_not_ours(st: os.stat_result) -> str | None:
    """None when `st` is a regular file that only edgeserve's user can have written."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by edgeserve's user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"others can write it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open(path: Path) -> int:
    # O_NOFOLLOW: a symlink planted in the cache is refused, not followed to some file of ours.
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)


def _read_fd(fd: int, size: int) -> bytes:
    with os.fdopen(os.dup(fd), "rb") as fh:
        data = fh.read()
    if len(data) != size:  # only edgeserve's user can write it: a short read means a bug or a disk fault
        raise Rejected(f"it changed while read ({len(data)} of {size} bytes)")
    return data


def read_seal(path: Path) -> dict[str, Any]:
    """The seal of `path`; raises Rejected when there is none of ours."""
    try:
        fd = _open(seal_path(path))
    except FileNotFoundError:
        raise Rejected("it has no seal (not written by this edgeserve)") from None
    except OSError as exc:
        raise Rejected(f"its seal cannot be opened ({exc.strerror or exc})") from None
    try:
        reason = why_not_ours(os.fstat(fd))
        if reason is not None:
            raise Rejected(f"its seal is not ours: {reason}")
        raw = os.read(fd, _MAX_SEAL_BYTES + 1)
    finally:
        os.close(fd)
    try:
        seal = json.loads(raw) if len(raw) <= _MAX_SEAL_BYTES else None
    except ValueError:
        seal = None
    if not isinstance(seal, dict) or seal.get("format") != SEAL_FORMAT:
        raise Rejected("its seal is malformed")
    if seal.get("name") != path.name:  # a seal of ours renamed beside another file
        raise Rejected(f"its seal is for {seal.get('name')!r}")
    for field in ("size", "ino", "mtime_ns"):
        if not isinstance(seal.get(field), int):
            raise Rejected("its seal is malformed")
    if not isinstance(seal.get("sha256"), str):
        raise Rejected("its seal is malformed")
    return seal


def _write_seal(path: Path, digest: str, st: os.stat_result) -> None:
    seal = {"format": SEAL_FORMAT, "name": path.name, "sha256": digest, "size": st.st_size,
            "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}  # fmt: skip
    write_bytes_atomic(seal_path(path), json.dumps(seal, sort_keys=True).encode())


def _verified(fd: int, path: Path, read: Callable[[int, int], T]) -> T:
    """`read(fd, size)` of a file whose content matches its seal; raises Rejected."""
    st = os.fstat(fd)
    reason = why_not_ours(st)
    if reason is not None:
        raise Rejected(reason)
    seal = read_seal(path)
    if st.st_size != seal["size"]:
        raise Rejected(f"it holds {st.st_size} bytes, its seal says {seal['size']}")
    data = read(fd, st.st_size)
    if (st.st_ino, st.st_mtime_ns) == (seal["ino"], seal["mtime_ns"]):
        return data  # unchanged since we sealed it, and nobody but us can have written it
    digest = hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else sha256_fd(fd)
    if digest != seal["sha256"]:
        sealed = str(seal["sha256"])[:16]
        raise Rejected(f"its content (sha256 {digest[:16]}...) is not what was sealed ({sealed}...)")
    with contextlib.suppress(OSError):  # same bytes, new inode or mtime (a copy or restore): seal it anew
        _write_seal(path, digest, st)
    return data


def discard(path: Path, what: str, reason: str) -> None:
    """Remove a cache file that failed its check, and its seal, saying which and why."""
    log.warning("discarding %s %s: %s; it is rebuilt, not loaded", what, path, reason)
    for victim in (path, seal_path(path)):
        try:
            victim.unlink(missing_ok=True)
        except IsADirectoryError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", victim, exc)


def _load(path: Path, what: str, read: Callable[[int, int], T]) -> T | None:
    try:
        fd = _open(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        discard(path, what, f"it cannot be opened ({exc.strerror or exc})")
        return None
    try:
        return _verified(fd, path, read)
    except Rejected as exc:
        reason = str(exc)
    except (OSError, ValueError) as exc:
        reason = f"it cannot be read ({exc})"
    finally:
        os.close(fd)
    discard(path, what, reason)
    return None


def read_sealed(path: Path, what: str) -> bytes | None:
    """The bytes of a sealed cache file; None when it is missing or was discarded (see the module doc)."""
    return _load(path, what, _read_fd)


def is_sealed(path: Path, what: str) -> bool:
    """True when `path` passes its check (content hashed without reading it into memory); else discarded."""
    return _load(path, what, lambda fd, size: True) is not None


def write_sealed(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write `path` atomically (mode 0600, fsync, rename) and then its seal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            st = os.fstat(fh.fileno())  # the rename keeps inode and mtime: the seal's fast path holds
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    _write_seal(path, digest, st)


def seal_existing(path: Path) -> None:
    """Seal a file edgeserve itself wrote in place (an engine a child process built, a runtime's cache
    file); raises Rejected when it is not ours to seal."""
    fd = _open(path)
    try:
        st = os.fstat(fd)
        reason = why_not_ours(st)
        if reason is not None:
            raise Rejected(reason)
        digest = sha256_fd(fd)
    finally:
        os.close(fd)
    _write_seal(path, digest, st)


def _cache_files(folder: Path) -> Iterable[Path]:
    """The files a runtime keeps in `folder` (recursively), not our seals or in-progress temporaries."""
    for root, dirs, files in os.walk(folder):  # os.walk does not follow symlinked folders
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(files):
            if not name.endswith(SEAL_SUFFIX) and not name.startswith("."):
                yield Path(root) / name


def check_folder(folder: Path, what: str) -> list[Path]:
    """Before a runtime reads its own cache in `folder`: discard every file that fails its check (a
    file with no seal too: the runtime would trust it). Returns what was discarded."""
    discarded = []
    if folder.is_dir():
        for file in _cache_files(folder):
            if not is_sealed(file, what):
                discarded.append(file)
        for seal in folder.rglob(f"*{SEAL_SUFFIX}"):  # seals whose file is gone
            if not seal.with_name(seal.name.removesuffix(SEAL_SUFFIX)).exists():
                seal.unlink(missing_ok=True)
    return discarded


def seal_folder(folder: Path) -> None:
    """After a runtime wrote its cache in `folder`: seal the new files (ours only; others are left for
    the next check_folder to discard)."""
    if not folder.is_dir():
        return
    for file in _cache_files(folder):
        try:
            read_seal(file)
            continue  # sealed earlier; check_folder verified it
        except Rejected:
            pass
        try:
            seal_existing(file)
        except (Rejected, OSError) as exc:
            log.warning("not sealing %s: %s", file, exc)


@contextlib.contextmanager
def runtime_folder(folder: Path | None, what: str) -> Iterator[None]:
    """Around a runtime that reads and writes its own cache in `folder` (None: no cache): the files
    are checked before it starts and its new ones sealed after."""
    if folder is not None:
        check_folder(folder, what)
    yield
    if folder is not None:
        seal_folder(folder)
