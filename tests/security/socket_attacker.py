"""Another local user's moves against edgeserve's Unix sockets (tests/security/test_private_sockets.py,
test_zmq_foreign_socket.py).

`start(uid, groups, move, *args)` starts this file with the test's interpreter as root (it lives where
only root may read), which imports what the move needs, drops to `uid` with supplementary `groups` for
good, prints "go", and then:

- `race PATH...`: connects to each PATH over and over until its stdin closes (spinning the moment a file
  appears in their folders: inotify), and on a connection asks the HTTP API for the repository index;
  then prints {PATH: {"connected", "denied", "absent", "answer", "events"}}, "events" being what
  inotify saw happen to the name: "created" (born there), "moved in" (renamed there), "changed" (its
  mode or owner changed while it was reachable)
- `squat PATH`: creates an empty file at PATH -> {"ok": true} or {"error": errno name}
- `serve ENDPOINT`: a ZeroMQ ROUTER bound there (mode 0666), answering every message as edgeserve
  would, until stdin closes -> {"received": messages}
- `ping ENDPOINT`: edgeserve's own client pings the server there -> {"ok": true} or {"error": status}
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

GROUP_MEMBER = 64990  # a uid of no one on the box, put in the server's group by `groups`
IN_CREATE, IN_MOVED_TO, IN_ATTRIB = 0x100, 0x80, 0x4
SPIN = 2000  # connect() attempts per name after a wake-up: the window a chmod after listen() leaves


def start(uid: int, groups: list[int], move: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, str(uid), ",".join(map(str, groups)), move, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert process.stdout is not None
    line = ""
    while not line.endswith("\n"):  # byte by byte: a buffered readline would hide what follows from finish()
        byte = os.read(process.stdout.fileno(), 1)
        if not byte:
            break
        line += byte.decode()
    if line.strip() != "go":
        process.kill()
        err = process.stderr.read() if process.stderr else ""
        raise RuntimeError(f"attacker did not start: {line!r} {err}")
    return process


def finish(process: subprocess.Popen[str], timeout: float = 120.0) -> Any:
    """Close its stdin (the move ends) and read its one JSON answer."""
    out, err = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"attacker failed ({process.returncode}):\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(uid: int, groups: list[int], move: str, *args: str, timeout: float = 120.0) -> Any:
    return finish(start(uid, groups, move, *args), timeout)


# -- the attacker's process ----------------------------------------------------------------------------
def _stdin_closed() -> threading.Event:
    closed = threading.Event()

    def wait() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait, daemon=True).start()
    return closed


def _watch(paths: list[str]) -> int:
    """An inotify descriptor that wakes on anything made in the paths' folders: the attacker spins on
    connect() the moment a socket file appears, as a real one would (ctypes: no inotify in stdlib)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    for folder in {os.path.dirname(path) for path in paths}:
        if libc.inotify_add_watch(fd, folder.encode(), IN_CREATE | IN_MOVED_TO | IN_ATTRIB) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
    return fd


def _try(path: str, seen: dict[str, Any]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except PermissionError:
        seen["denied"] += 1
        return
    except OSError:
        seen["absent"] += 1
        return
    else:  # the attacker's prize: the admin API on a connection nobody checks
        seen["connected"] += 1
        sock.settimeout(5)
        try:
            sock.sendall(b"POST /v2/repository/index HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
            seen["answer"] = sock.recv(200).decode(errors="replace")
        except OSError as exc:
            seen["answer"] = repr(exc)
    finally:
        sock.close()


def _events(buffer: bytes, names: dict[str, dict[str, Any]]) -> None:
    """Note what happened to each watched name (struct inotify_event: wd, mask, cookie, len, name)."""
    offset = 0
    while offset + 16 <= len(buffer):
        _wd, mask, _cookie, size = struct.unpack_from("iIII", buffer, offset)
        name = buffer[offset + 16 : offset + 16 + size].split(b"\0", 1)[0].decode()
        offset += 16 + size
        if name in names:
            for bit, word in ((IN_CREATE, "created"), (IN_MOVED_TO, "moved in"), (IN_ATTRIB, "changed")):
                if mask & bit and word not in names[name]["events"]:
                    names[name]["events"].append(word)


def _race(paths: list[str]) -> dict[str, Any]:
    stats = {path: {"connected": 0, "denied": 0, "absent": 0, "answer": "", "events": []} for path in paths}
    by_name = {os.path.basename(path): stats[path] for path in paths}
    closed = _stdin_closed()
    watch = _watch(paths)
    while not closed.is_set():
        woken = select.select([watch], [], [], 0.01)[0]
        if woken:
            with contextlib.suppress(BlockingIOError):
                while True:
                    _events(os.read(watch, 65536), by_name)
        for _ in range(SPIN if woken else 1):  # something appeared: spin on every name
            for path in paths:
                _try(path, stats[path])
    os.close(watch)
    return stats


def _squat(path: str) -> dict[str, Any]:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError as exc:
        return {"error": errno.errorcode.get(exc.errno or 0, str(exc))}
    return {"ok": True}


def _serve(zmq: Any, endpoint: str) -> dict[str, Any]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)
    os.chmod(endpoint.removeprefix("ipc://"), 0o666)
    print("go", flush=True)  # bound: the test may go on
    received = 0
    closed = _stdin_closed()
    while not closed.is_set():
        if not sock.poll(50):
            continue
        frames = sock.recv_multipart()
        received += 1
        header = json.loads(frames[1])
        reply = {"v": 1, "id": header.get("id"), "status": "OK", "server": "edgeserve", "wire": 1}
        sock.send_multipart([frames[0], json.dumps(reply).encode()])
    sock.close(0)
    ctx.term()
    return {"received": received}


def _ping(client_class: Any, endpoint: str) -> dict[str, Any]:
    try:
        with client_class(endpoint, timeout=20.0) as client:
            client.ping()
    except Exception as exc:
        return {"error": getattr(exc, "status", type(exc).__name__), "message": str(exc)}
    return {"ok": True}


def main() -> None:
    uid, groups, move, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    zmq: Any = None
    client_class: Any = None
    if move == "serve":
        import zmq
    if move == "ping":
        from edgeserve.client import ZmqClient as client_class
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("could not drop privileges")
    if move != "serve":
        print("go", flush=True)
    if move == "race":
        answer = _race(args)
    elif move == "squat":
        answer = _squat(args[0])
    elif move == "serve":
        answer = _serve(zmq, args[0])
    else:
        answer = _ping(client_class, args[0])
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
