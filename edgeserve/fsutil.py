"""Crash-safe file updates: a reader, or the next start after a power cut, sees the old or the new
content, never half of it. And modes that do not depend on the umask.

Under systemd the service runs with `UMask=0007` so that camera clients in group `edgeserve` can reach
its ZeroMQ socket (the frontend gives the socket that access itself). Nothing else it creates may be
the group's: a group member who can write an installed bundle, a cache, the settings overlay or the
command ledger runs its own code as the service. So the supervisor and the server set their own umask
at start (`protect_process`), folders get explicit modes (`private_mkdir`, `seal_tree`), atomic writes
are owner-only, and what an earlier release left group-writable is tightened at start (`harden`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

PRIVATE_DIR = 0o700  # the service's own state: journal, ledger, overlay, caches, staging
PRIVATE_FILE = 0o600
SEALED_DIR = 0o755  # an installed bundle: readable (an operator's CLI may have installed it), never
SEALED_FILE = 0o644  # writable but by its owner
GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH

log = logging.getLogger("edgeserve")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_mkdir(path: Path, mode: int = PRIVATE_DIR) -> Path:
    """`mkdir -p` whose every created folder gets exactly `mode` (chmod after mkdir: the umask only
    takes bits away, and `mode` must hold whatever the umask). An existing folder keeps its mode but
    loses group and other write."""
    missing: list[Path] = []
    probe = path
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            folder.mkdir(mode)
            os.chmod(folder, mode)
    if not missing:
        drop_group_write(path)
    return path


def drop_group_write(path: Path) -> bool:
    """Take group and other write away from `path` (never through a link); True when it had them.
    A path of another owner that we may not chmod is left as it is."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not st.st_mode & GROUP_OTHER_WRITE:
            return False
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~GROUP_OTHER_WRITE)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def replace_symlink(link: Path, target: str) -> None:
    """Point `link` at `target` in one rename (never a moment without the link), then fsync."""
    tmp = link.with_name(f".{link.name}.new")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def write_text_atomic(path: Path, text: str, mode: int = PRIVATE_FILE) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_bytes_atomic(path: Path, data: bytes, mode: int = PRIVATE_FILE) -> None:
    """Write to a temporary file, fsync, rename over `path`, fsync the folder. The file gets exactly
    `mode` (owner-only unless told otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def seal_tree(root: Path, dir_mode: int = SEALED_DIR, file_mode: int = SEALED_FILE) -> None:
    """Exact modes on a whole tree (links are neither followed nor changed)."""
    os.chmod(root, dir_mode)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), dir_mode)
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), file_mode)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (bundles and models can be larger than memory)."""
    with open(path, "rb") as fh:
        return sha256_fd(fh.fileno())


def sha256_fd(fd: int) -> str:
    """Hex SHA-256 of an open file from its start, in 1 MiB chunks (pread: the file offset is untouched),
    so a caller that opened and checked the file hashes exactly what it checked."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


# -- the service's state folder -----------------------------------------------------------------------
SERVICE_UMASK = 0o077
# What the service writes under the state folder (ota/: bundles, journal, links; cache/: compiled
# models; overrides/: files sent with a load; fleet/: ledger, outbox, settings overlay); trust/ is the
# default key folder, which a group member must never be able to add a key to.
OWN_ENTRIES = ("ota", "cache", "overrides", "fleet", "trust", "revoked-keys.json", "runtime-plan.json")
REPORTED = 5  # paths named in the log line; the rest are counted


def protect_process() -> None:
    """Owner-only modes for whatever this process (and its children) creates from now on, and no
    bytecode written next to a model's code (`__pycache__` in a bundle would be a file its manifest
    does not list, and a planted .pyc would run instead of the signed .py)."""
    os.umask(SERVICE_UMASK)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True


def tighten(state_dir: Path) -> list[str]:
    """Take group and other write away from the state folder and what the service keeps in it (folders
    and regular files; links and sockets are left alone). Returns the paths changed, relative."""
    changed: list[str] = []
    if drop_group_write(state_dir):
        changed.append(".")
    for name in OWN_ENTRIES:
        top = state_dir / name
        if not top.exists() or top.is_symlink():
            continue
        if drop_group_write(top):
            changed.append(name)
        if not top.is_dir():
            continue
        for folder, dirs, files in os.walk(top):
            for entry in (*dirs, *files):
                path = Path(folder, entry)
                try:
                    kind = os.lstat(path).st_mode
                except OSError:
                    continue
                if (stat.S_ISDIR(kind) or stat.S_ISREG(kind)) and drop_group_write(path):
                    changed.append(str(path.relative_to(state_dir)))
    return changed


def harden(state_dir: Path) -> None:
    """`tighten`, with one log line saying what an earlier release left group-writable."""
    try:
        changed = tighten(state_dir)
    except OSError as exc:
        log.error("state folder %s: cannot check its modes: %s", state_dir, exc)
        return
    if changed:
        more = len(changed) - REPORTED
        shown = ", ".join(changed[:REPORTED]) + (f" and {more} more" if more > 0 else "")
        log.warning("state folder %s: group/other write taken away from %s (left by an earlier release)",
                    state_dir, shown)  # fmt: skip
