"""The running appliance's door for `edgeserve bundle install|rollback|status`: a Unix socket in the
state folder (`supervisor.sock`, mode 0600). One JSON request line in; JSON event lines out (progress,
then one `done`). The installer runs here, in the supervisor, so it outlives a crashing server."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeserve.logs import safe
from edgeserve.ota.errors import StoreError
from edgeserve.ota.installer import Installer, Outcome
from edgeserve.ota.store import Store
from edgeserve.private_socket import unix_listener

log = logging.getLogger("edgeserve.supervisor")

SOCKET_NAME = "supervisor.sock"
MAX_REQUEST_BYTES = 64 * 1024
MAX_CONNECTIONS = 4


def socket_path(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


class OtaService:
    def __init__(self, store: Store, make_installer: Callable[[], Installer],
                 on_outcome: Callable[[Outcome], None]) -> None:  # fmt: skip
        self.store = store
        self.make_installer = make_installer
        self.on_outcome = on_outcome
        self.path = socket_path(store.state_dir)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stopping = threading.Event()

    def start(self) -> None:
        self.store.ensure()
        # Born 0600 (installing is an admin's act), replacing a stale one in one rename; no umask
        # juggling: the umask is the whole process's, and the fleet agent's threads may be writing.
        sock = unix_listener(self.path, 0o600, backlog=8)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="ota-service", daemon=True)
        self._thread.start()
        log.info("bundle installs: %s", self.path)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                with conn:
                    _send(conn, {"event": "done", "ok": False, "error": "busy: too many connections"})
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ota-request", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(10)
                request = _read_request(conn)
                conn.settimeout(None)
                _send(conn, self._handle(request, lambda event: _send(conn, event)))
        except (OSError, ValueError) as exc:
            log.warning("bundle request failed: %s", safe(exc, 200))
        finally:
            self._slots.release()

    def _handle(self, request: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        op = request.get("op")

        def report(state: str, progress: float | None, message: str) -> None:
            with contextlib.suppress(OSError):  # the CLI may go away; the install goes on
                send({"event": "progress", "state": state, "progress": progress, "message": message})

        try:
            if op == "status":
                return {"event": "done", "ok": True, "status": self.store.status()}
            if op == "install" and isinstance(request.get("source"), str):
                log.info("bundle install requested: %s", safe(request["source"], 300))
                outcome = self.make_installer().install(
                    request["source"], report, sha256=request.get("sha256")
                )
            elif op == "rollback" and isinstance(request.get("to"), int):
                outcome = self.make_installer().rollback(int(request["to"]), report)
            else:
                return {"event": "done", "ok": False, "error": f"unknown request {op!r}"}
        except StoreError as exc:
            return {"event": "done", "ok": False, "error": str(exc)}
        self.on_outcome(outcome)
        return {"event": "done", **outcome.to_dict()}


def _read_request(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    request = json.loads(data or b"{}")
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def _send(conn: socket.socket, event: dict[str, Any]) -> None:
    conn.sendall(json.dumps(event).encode() + b"\n")


def call(
    state_dir: Path, request: dict[str, Any], on_event: Callable[[dict[str, Any]], None]
) -> dict[str, Any] | None:
    """Client side: None when no appliance serves this state folder; else the final `done` event."""
    path = socket_path(state_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    with sock, sock.makefile("rb") as stream:
        sock.sendall(json.dumps(request).encode() + b"\n")
        for line in stream:
            event = json.loads(line)
            if event.get("event") == "done":
                return dict(event)
            on_event(event)
    return {"event": "done", "ok": False, "error": "the appliance closed the connection"}
