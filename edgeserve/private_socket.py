"""Unix sockets that are private from birth: no moment in which a wider mode lets anyone connect.

A socket file takes the process umask when bound; chmod'ing it after listening leaves a window in
which a group member connects (and keeps that connection). os.umask() would close it, but it is
process-wide: the server's other threads (model loads, caches) would create their files under it
meanwhile. So the socket is bound inside a fresh 0700 folder next to its final name, where nobody
else can reach it whatever its mode, given its mode there, and renamed into place: the name appears
already carrying the mode, and rename() replaces a stale file of ours in one step.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

SOCKET_BACKLOG = 64


def bind_private(path: Path, mode: int, bind: Callable[[str], object]) -> None:
    """Call `bind(tmp_path)` (whatever creates the socket file: socket.bind, libzmq's bind), give
    the file `mode`, and rename it to `path`. OSError if any step fails (nothing left behind)."""
    # 0700 whatever the umask; a short name: a socket path has at most 107 bytes
    folder = tempfile.mkdtemp(prefix=".b-", dir=path.parent)
    tmp = os.path.join(folder, "s")
    try:
        bind(tmp)
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def unix_listener(path: Path, mode: int = 0o600, backlog: int = SOCKET_BACKLOG) -> socket.socket:
    """A listening AF_UNIX stream socket at `path` with `mode` from birth (see the module)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)

    def bind(tmp: str) -> None:
        sock.bind(tmp)
        sock.listen(backlog)  # before the rename: a client that finds the name is never refused

    try:
        bind_private(path, mode, bind)
    except BaseException:
        sock.close()
        raise
    return sock
