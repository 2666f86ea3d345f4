"""How a client finds the appliance's ZeroMQ endpoint, and makes sure an ipc one is the server's.

Finding (`find_endpoint`): the settings the appliance reads — `config`, else
$CONFIGURATION_DIRECTORY/edgeserve.toml, else the systemd install's /etc/edgeserve/edgeserve.toml,
then EDGESERVE_ZMQ_ENDPOINTS — and the first of their `[zmq] endpoints`; when they name none, the
default socket where the server puts it (edgeserve/frontends/zmq/endpoint.py): the first of its
places that holds a socket.

Trusting (`check_ipc`): another user's socket at the name would receive this client's frames and
answer them. An ipc socket must belong to the server's user: `server_user` when given, else the
owner of the socket's folder or this client's own user. A socket of anyone else, or a file that is
no socket, is refused before connecting; and since a server may come (or come back) after the
client connected, each reply's sender is checked too (libzmq reports an ipc peer's uid):
a reply from anyone else fails its request.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from edgeserve.client.errors import ClientError
from edgeserve.frontends.zmq.endpoint import client_candidates, ipc_path

SYSTEM_SETTINGS = Path("/etc/edgeserve/edgeserve.toml")  # where the systemd install puts them
_IPC_PEER = re.compile(r".*:(\d+):\d+:\d+")  # libzmq's Peer-Address of an ipc peer: host:uid:gid:pid


def settings_file(config: Path | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """`config`, else $CONFIGURATION_DIRECTORY/edgeserve.toml, else /etc/edgeserve/edgeserve.toml,
    when there and readable (a camera client may not be allowed to read them)."""
    if config is not None:
        return config
    env = os.environ if environ is None else environ
    directory = env.get("CONFIGURATION_DIRECTORY", "").split(":")[0]
    for candidate in ([Path(directory) / "edgeserve.toml"] if directory else []) + [SYSTEM_SETTINGS]:
        if candidate.is_file() and os.access(candidate, os.R_OK):
            return candidate
    return None


def find_endpoint(config: Path | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The appliance's ZeroMQ endpoint as its settings say (see the module). ConfigError for
    settings the appliance would refuse as well."""
    from edgeserve.config import load_settings_with_sources
    from edgeserve.settings_tools import resolve_state_dir

    settings, sources = load_settings_with_sources(settings_file(config, environ), environ)
    if settings.zmq.endpoints:
        return settings.zmq.endpoints[0]
    candidates = client_candidates(resolve_state_dir(settings, sources, environ)[0], environ)
    for candidate in candidates:
        try:
            if stat.S_ISSOCK(candidate.lstat().st_mode):
                return f"ipc://{candidate}"
        except OSError:
            continue
    return f"ipc://{candidates[0]}"


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _uid(user: str | int) -> int:
    if isinstance(user, int) or user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ClientError("INVALID_ARG", f"server_user {user!r}: no such user") from None


def expected_owners(path: Path, server_user: str | int | None = None) -> frozenset[int]:
    """Who may own the server's socket at `path`: `server_user`, else its folder's owner or us."""
    if server_user is not None:
        return frozenset({_uid(server_user)})
    owners = {os.geteuid()}
    with contextlib.suppress(OSError):  # no folder (yet), or not ours to look into: connecting says
        owners.add(path.parent.stat().st_uid)
    return frozenset(owners)


def check_ipc(endpoint: str, server_user: str | int | None = None) -> frozenset[int] | None:
    """The uids a reply over `endpoint` may come from (None: not an ipc socket file, nothing to
    check); PERMISSION_DENIED when the socket there now is not the server's."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    owners = expected_owners(path, server_user)
    try:
        info = path.stat()  # a link is followed: whoever owns what it leads to is what counts
    except OSError:  # no server yet (or a folder we cannot search): replies are checked
        return owners
    expected = " or ".join(user_name(uid) for uid in sorted(owners))
    fix = (
        "remove it (as its owner or root) and start the server, or point the client at the server's "
        "endpoint (endpoint=..., [zmq] endpoints; server_user=... when the server runs as another user)"
    )
    if not stat.S_ISSOCK(info.st_mode):
        raise ClientError(
            "PERMISSION_DENIED",
            f"{endpoint}: {path} is not a socket (owner {user_name(info.st_uid)}), not an edgeserve "
            f"server's: {fix}",
        )
    if info.st_uid not in owners:
        raise ClientError(
            "PERMISSION_DENIED",
            f"{endpoint}: the socket {path} belongs to {user_name(info.st_uid)}, not to the server's user "
            f"({expected}): it would receive this client's requests; {fix}",
        )
    return owners


def foreign_peer(address: object, owners: frozenset[int], endpoint: str) -> str | None:
    """Why a reply whose Peer-Address is `address` is not the server's (None: it is, or libzmq
    does not say whose it is here)."""
    match = _IPC_PEER.fullmatch(address) if isinstance(address, str) else None
    if match is None or int(match.group(1)) in owners:
        return None
    return (
        f"a reply over {endpoint} came from {user_name(int(match.group(1)))}, not from the server's user "
        f"({' or '.join(user_name(uid) for uid in sorted(owners))}): another user's socket is at that "
        "name; the reply was refused"
    )
