"""Where the ZeroMQ ipc socket lives when `[zmq] endpoints` names none: a folder only the service
user can write, never a fixed name in the shared, sticky /tmp (another user's file there would stop
the server, a socket of theirs would receive the cameras' frames). The server and its clients find
it the same way (the clients: edgeserve/client/endpoint.py). Standard library only: every client
imports this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "edgeserve.zmq"
# The systemd install's runtime folder (RuntimeDirectory=edgeserve in systemd/edgeserve.service):
# /run is root's, so only systemd makes it, owned by the service user.
SYSTEMD_RUNTIME_DIR = Path("/run/edgeserve")


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint; None for other transports and Linux's abstract
    namespace (ipc://@name: no file)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    if not path or path.startswith("@"):
        return None
    return Path(os.path.abspath(path))


def server_default(state_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """The server's default socket: systemd's $RUNTIME_DIRECTORY (/run/edgeserve, group edgeserve),
    else $XDG_RUNTIME_DIR/edgeserve (the login session's private folder), else `<state_dir>/run`."""
    env = os.environ if environ is None else environ
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime) / SOCKET_NAME
    return _user_default(state_dir, env)


def _user_default(state_dir: Path, env: Mapping[str, str]) -> Path:
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "edgeserve" / SOCKET_NAME
    return state_dir / "run" / SOCKET_NAME


def client_candidates(state_dir: Path, environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where a client looks when no settings name an endpoint, in order: this user's own server
    (as `server_default` finds it outside systemd), then the systemd install's. A client's own
    $RUNTIME_DIRECTORY is its own service's, not the server's: not looked at."""
    env = os.environ if environ is None else environ
    own = _user_default(state_dir, env)
    candidates = [own, SYSTEMD_RUNTIME_DIR / SOCKET_NAME]
    if own != state_dir / "run" / SOCKET_NAME:  # a server started without the session's variables
        candidates.append(state_dir / "run" / SOCKET_NAME)
    return candidates
