"""The worker process of a `python_worker_group` (inside the worker; the server's side is group.py).

The server sends `{"op": "attach", "label": ...}` with four fds (a member's control channel and its
shared-memory file, its event channel and that channel's shared memory) over the group channel
(SOCK_SEQPACKET); each member is then served on a thread
of its own by the same `Stub` a worker of its own runs, its model.py imported under a name of its own
(`model_1`, `model_2`, ...). The worker ends when the server closes the group channel (its last
member left, or the server died).

A member's SystemExit (sys.exit in user code) ends the whole process with its code, as it would end a
worker of its own: the group's members restart together (group.py). Two members whose folders hold a
helper module of the same name (both import `utils`) would share the first one imported: the second
is refused with the name and the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeserve.backends.python import wire

MAX_MESSAGE = 1 << 16
_helpers: dict[str, str] = {}  # helper module name -> the member folder it is imported from
_helpers_lock = threading.Lock()
_names = itertools.count(1)


def helper_modules(folder: str) -> set[str]:
    """Module names a model folder provides besides model.py (files and packages)."""
    names: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in Path(folder).iterdir():
            if entry.is_file() and entry.suffix == ".py" and entry.stem != "model":
                names.add(entry.stem)
            elif entry.is_dir() and (entry / "__init__.py").is_file():
                names.add(entry.name)
    return names


def helper_clash(folder: str) -> str | None:
    """None when the folder's helper modules are its own in this process; else the refusal."""
    with _helpers_lock:
        mine = helper_modules(folder)
        for name in sorted(mine):
            other = _helpers.get(name)
            if other is not None and other != folder:
                return (
                    f"its helper module '{name}' has the same name as one in {other}, whose model shares "
                    "this Python worker (python_worker_group): both would import the first one loaded; "
                    "rename it, or give this model a python_worker_group of its own"
                )
        for name in mine:
            _helpers[name] = folder
    return None


def _exit_with(code: Any) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _member(stub: Any) -> None:
    try:
        stub.serve()
    except SystemExit as exc:  # as in a worker of its own: the model asked the process to end
        _exit_with(exc.code)
    except BaseException:  # the worker's own failure: a member lost would hang the server's calls
        _exit_with(70)
    finally:
        with contextlib.suppress(OSError):
            stub.sock.close()


def serve_group(sock: socket.socket, make_stub: Callable[..., Any]) -> int:
    """Attach members until the server closes the group channel."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            return 0
        if not data:
            for fd in fds:
                os.close(fd)
            return 0  # the server closed the channel: no member left, or the server is gone
        try:
            message = json.loads(data)
            if not isinstance(message, dict) or message.get("op") != "attach" or len(fds) != 4:
                raise ValueError(f"expected an attach message with 4 fds, got {len(fds)} fds")
            region = wire.Region(fds[1])
            events = wire.Region(fds[3])
        except (ValueError, OSError) as exc:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            sock.send(json.dumps({"error": str(exc)}).encode())
            continue
        stub = make_stub(socket.socket(fileno=fds[0]), region, f"model_{next(_names)}",
                         events=(socket.socket(fileno=fds[2]), events))  # fmt: skip
        label = str(message.get("label", ""))[:200]
        threading.Thread(target=_member, args=(stub,), name=f"member {label}", daemon=True).start()
        sock.send(json.dumps({"ok": True}).encode())
