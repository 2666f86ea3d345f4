"""Who may name a registered region: the client identity that registered it (`[shm] registration`).

Triton shares regions by name: any client that names a region another client registered reads it
(as the input of an identity model) or overwrites it (as an output region). Under
"peer-credentials" (the default) every region is bound to the identity of the client that registered
it, its *principal*, and region names are looked up among that principal's regions only:
- a client whose user the kernel tells (ZeroMQ ipc, HTTP/gRPC from loopback, HTTP on a Unix socket;
  see `edgeserve.frontends.peer`): its uid, so every process of one user shares its regions (they
  could open each other's memory anyway) and no other user, root included, can name them;
- any other client: its IP address (all clients behind one address share; the bearer token is one
  secret for every network client, so it tells them apart no better), or, without an address
  (gRPC on a Unix socket, ZeroMQ ipc where libzmq reports no credentials), its transport;
- an in-process caller: "in-process".
A region registered over ZeroMQ is also bound to the ZeroMQ socket that registered it, as its lease
is: requests on other sockets (or over HTTP/gRPC) cannot name it, even of the same user.

Another principal's region is answered exactly as a region that does not exist (NOT_FOUND, the
same message), so a client learns nothing about other clients' regions, and two users may use the
same region name. "triton" restores name-global regions that any client may use.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

IN_PROCESS = "in-process"
# The owner of regions registered over the Triton protocol (HTTP/gRPC); ZeroMQ regions are owned by
# their client socket ("zmq:<routing id>"), so a Triton "unregister all" leaves camera rings alone.
TRITON_OWNER = ""


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """A client connection: how it arrived, its address and, for a local client, its user."""

    transport: str  # "zmq-ipc", "zmq-tcp", "unix", "tcp"
    address: str
    uid: int | None = None
    gid: int | None = None
    pid: int | None = None
    proc_root: Path = Path("/proc")

    @property
    def known(self) -> bool:
        return self.uid is not None

    def describe(self) -> str:
        if self.uid is None:
            return f"a client at {self.address or 'an unknown address'} ({self.transport}; user unknown)"
        return f"uid {self.uid} ({self.transport})"

    def groups(self) -> frozenset[int]:
        """The groups the client acts with: its process's when it is still there and still runs as
        that user, else the user's groups in the account database (plus the gid SO_PEERCRED gave)."""
        if self.uid is None:
            return frozenset()
        found = _process_groups(self.proc_root, self.pid, self.uid) if self.pid else None
        if found is not None:
            return found
        groups = {self.gid} if self.gid is not None else set()
        try:
            entry = pwd.getpwuid(self.uid)
            groups.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except (KeyError, OSError):  # a uid without an account (a container's) has only its gid
            pass
        return frozenset(groups)


def _process_groups(proc_root: Path, pid: int, uid: int) -> frozenset[int] | None:
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:  # gone, or hidden (ProtectProc=invisible)
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        if int(fields["Uid"].split()[1]) != uid:  # the pid now belongs to someone else
            return None
        return frozenset([int(fields["Gid"].split()[1]), *(int(g) for g in fields["Groups"].split())])
    except (KeyError, IndexError, ValueError):
        return None


def principal_of(peer: PeerIdentity | None) -> str:
    """The identity a region registered by (or a request from) `peer` is bound to."""
    if peer is None:
        return IN_PROCESS
    if peer.uid is not None:
        return f"uid:{peer.uid}"
    host = peer.address if peer.transport == "zmq-tcp" else peer.address.rpartition(":")[0]
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return f"anonymous:{peer.transport}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"host:{ip}"


class ShmClient:
    """The client naming regions in a request or a shared-memory call.

    `peer` may be a function: the lookup (reading /proc/net/tcp for a loopback peer) then runs only
    when the request names a region, once. `owner`: the ZeroMQ socket ("" over HTTP/gRPC)."""

    __slots__ = ("_lookup", "_peer", "_principal", "owner")

    def __init__(
        self, peer: PeerIdentity | Callable[[], PeerIdentity] | None = None, owner: str = TRITON_OWNER
    ) -> None:
        self.owner = owner
        self._lookup = peer if callable(peer) else None
        self._peer = None if callable(peer) else peer
        self._principal: str | None = None

    @property
    def peer(self) -> PeerIdentity | None:
        lookup = self._lookup
        if lookup is not None:  # two threads may both look it up: the same answer, no harm
            self._peer, self._lookup = lookup(), None
        return self._peer

    @property
    def principal(self) -> str:
        if self._principal is None:
            self._principal = principal_of(self.peer)
        return self._principal


IN_PROCESS_CLIENT = ShmClient()
