"""The supervisor's view of the server: the server's own HTTP API (health, repository index, model
config), reached over a private Unix socket so it works with HTTP disabled or on port 0."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class ServerUnreachable(Exception):
    """No answer in time (down, starting, wedged or stopped)."""


@dataclass
class ModelState:
    name: str
    version: str
    state: str  # READY | LOADING | UNLOADING | UNAVAILABLE | "" (never loaded)
    reason: str = ""


@dataclass
class ServerView:
    """One health round: what the server said about itself."""

    live: bool
    ready: bool
    models: list[ModelState] = field(default_factory=list)


class ServerControl:
    def __init__(self, socket_path: Path, timeout_s: float) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        connection = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerUnreachable(f"{method} {path}: {exc or type(exc).__name__}") from None
        finally:
            connection.close()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        return response.status, data

    def view(self) -> ServerView:
        """Live + ready + the repository index; raises ServerUnreachable when it does not answer."""
        status, _ = self.request("GET", "/v2/health/live")
        if status != 200:
            return ServerView(live=False, ready=False)
        ready_status, _ = self.request("GET", "/v2/health/ready")
        _, index = self.request("POST", "/v2/repository/index", {})
        models = [
            ModelState(str(e.get("name", "")), str(e.get("version", "")), str(e.get("state", "")),
                       str(e.get("reason", "")))
            for e in (index if isinstance(index, list) else [])
            if isinstance(e, dict)
        ]  # fmt: skip
        return ServerView(live=True, ready=ready_status == 200, models=models)

    def served_config(self, model: str) -> dict[str, Any] | None:
        try:
            status, config = self.request("GET", f"/v2/models/{model}/config")
        except ServerUnreachable:
            return None
        return config if status == 200 and isinstance(config, dict) else None
