"""Another local user's moves against edgeserve's Unix sockets (tests/security/test_private_sockets.py,
test_zmq_foreign_socket.py).

`start(uid, groups, move, *args)` starts this file with the test's interpreter as root (it lives where
only root may read), which imports what the move needs, drops to `uid` with supplementary `groups` for
good, prints "go", and then:

- `race PATH...`: connects to each PATH over and over until its stdin closes, and on a connection asks
  the HTTP API for the repository index; then prints {PATH: {"connected", "denied", "absent", "answer"}}
- `squat PATH`: creates an empty file at PATH -> {"ok": true} or {"error": errno name}
- `serve ENDPOINT`: a ZeroMQ ROUTER bound there (mode 0666), answering every message as edgeserve
  would, until stdin closes -> {"received": messages}
- `ping ENDPOINT`: edgeserve's own client pings the server there -> {"ok": true} or {"error": status}
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

GROUP_MEMBER = 64990  # a uid of no one on the box, put in the server's group by `groups`


def start(uid: int, groups: list[int], move: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, str(uid), ",".join(map(str, groups)), move, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
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


def _race(paths: list[str]) -> dict[str, Any]:
    stats = {path: {"connected": 0, "denied": 0, "absent": 0, "answer": ""} for path in paths}
    closed = _stdin_closed()
    while not closed.is_set():
        for path in paths:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
            except PermissionError:
                stats[path]["denied"] += 1
                continue
            except OSError:
                stats[path]["absent"] += 1
                continue
            else:  # the attacker's prize: the admin API on a connection nobody checks
                stats[path]["connected"] += 1
                sock.settimeout(5)
                try:
                    sock.sendall(b"POST /v2/repository/index HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
                    stats[path]["answer"] = sock.recv(200).decode(errors="replace")
                except OSError as exc:
                    stats[path]["answer"] = repr(exc)
            finally:
                sock.close()
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
