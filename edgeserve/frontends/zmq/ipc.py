"""The server's ipc:// sockets: their folder, what may already be at their name, and a bind that
gives the socket its mode before anyone can reach it (edgeserve/private_socket.py).

The socket is `0660` whatever the process umask (the server's is 0077): the service user and its
group (`Group=edgeserve` in the unit: the camera clients) may connect; who reaches it at all is the
folder's say (/run/edgeserve is 0750 edgeserve:edgeserve; the other defaults are 0700).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from edgeserve.private_socket import bind_private

log = logging.getLogger("edgeserve.zmq")

SOCKET_MODE = 0o660
PRIVATE_FOLDER_MODE = 0o700  # the default folders (XDG runtime, state dir): the service user only
SHARED_FOLDER_MODE = 0o750  # a folder made for a configured endpoint: its group may reach the socket


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def bind_ipc(bind: Callable[[str], object], endpoint: str, path: Path, default: bool) -> None:
    """Bind `endpoint` (whose file is `path`) by calling `bind("ipc://<temporary name>")`; the socket
    appears at `path` already SOCKET_MODE. `default`: the folder is the built-in one, kept private.
    RuntimeError with the fix for anything in the way."""
    _folder(path.parent, endpoint, default)
    _clear(path, endpoint)
    try:
        bind_private(path, SOCKET_MODE, lambda tmp: bind("ipc://" + tmp))
    except OSError as exc:
        raise RuntimeError(f"zmq frontend cannot bind {endpoint}: {exc}") from None


def _folder(folder: Path, endpoint: str, default: bool) -> None:
    """Make the socket's folder (each missing level with an explicit mode, whatever the umask); the
    default folder must be the service user's alone."""
    missing: list[Path] = []
    probe = folder
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for level in reversed(missing):
        with contextlib.suppress(FileExistsError):
            level.mkdir()
            level.chmod(PRIVATE_FOLDER_MODE if default else SHARED_FOLDER_MODE)
    if not default:
        return
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise RuntimeError(
            f"zmq endpoint {endpoint}: its folder {folder} belongs to {user_name(info.st_uid)}, not to "
            f"this server's user {user_name(os.geteuid())}: remove the folder, or set [zmq] endpoints"
        )
    if info.st_mode & 0o022:  # ours, but others could put a file of theirs at the socket's name
        folder.chmod(stat.S_IMODE(info.st_mode) & ~0o022)


def _clear(path: Path, endpoint: str) -> None:
    """A stale socket of ours (nobody listening) is left for the bind's rename to replace; anything
    else at the name (a live server, another user's file or socket, a non-socket) is an error."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    fix = (
        "remove it (as its owner or root), or set [zmq] endpoints to a path in a folder only this "
        "service's user can write (the default, [zmq] endpoints = [], is one)"
    )
    if not stat.S_ISSOCK(info.st_mode):
        what = f"{path} exists and is not a socket (owner {user_name(info.st_uid)})"
        raise RuntimeError(f"zmq endpoint {endpoint}: {what}: {fix}")
    if info.st_uid != os.geteuid():
        raise RuntimeError(
            f"zmq endpoint {endpoint}: {path} is a socket of {user_name(info.st_uid)}, not of this server's "
            f"user {user_name(os.geteuid())}: {fix}"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("replacing the stale zmq socket file %s", path)
        return
    except OSError as exc:
        raise RuntimeError(f"zmq endpoint {endpoint}: cannot check {path}: {exc}") from None
    finally:
        probe.close()
    raise RuntimeError(f"zmq endpoint {endpoint} is in use by another running process")
