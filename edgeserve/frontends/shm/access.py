"""Whose memory a client may register: the rule `[shm] registration` picks.

"peer-credentials" (the default): a client may register only memory it could open itself.
- A client whose user is known (ZeroMQ ipc, HTTP/gRPC from loopback, HTTP on a Unix socket; see
  `edgeserve.frontends.peer`) needs read permission on the object by its owner/group/other bits, as
  the kernel would grant it; outputs are written into the region only if it may write too. A memfd
  (`memfd:<name>:<pid>:<fd>`) needs its holder process to run as that user (who else could open
  /proc/<pid>/fd?). An object with a POSIX ACL is left to its owner. Root may register anything.
- Any other client (a LAN peer, ZeroMQ over tcp, a loopback socket whose owner could not be found)
  may register only objects of the server's own user, objects of the server's group that the group
  may read, or, when `[shm] key_prefixes` is set, keys under those prefixes.

"triton": any object the server's user can open, as Triton does (memfds only of the server's user).
Use it only where every client may read whatever the server's user can.
"""

from __future__ import annotations

import logging
import os
import stat

from edgeserve.frontends.shm.binding import PeerIdentity
from edgeserve.frontends.shm.keys import Opened
from edgeserve.protocol.errors import InferenceError, Status

log = logging.getLogger("edgeserve.shm")

PEER_CREDENTIALS = "peer-credentials"
TRITON = "triton"
REGISTRATION_MODES = (PEER_CREDENTIALS, TRITON)
_READ, _WRITE = 4, 2


def authorize(mode: str, peer: PeerIdentity | None, key: str, opened: Opened, prefixed: bool) -> bool:
    """Raise PERMISSION_DENIED unless the client may register `opened`; True when it may also have
    outputs written there. `prefixed`: the key matched a configured `[shm] key_prefixes` entry."""
    st = opened.st
    if mode == TRITON:
        if opened.memfd_holder is not None and st.st_uid != os.geteuid():
            raise _denied(key, "the memfd belongs to another user")
        return True
    if peer is None or peer.uid is None:
        if prefixed or _servers_own(opened):
            return True
        _log_refusal(peer, key, opened)
        raise _denied(
            key,
            f"{(peer or PeerIdentity('in-process', '')).describe()} may register only objects of the "
            "server's user or group, or keys under [shm] key_prefixes (a local client is identified "
            "over the ZeroMQ ipc socket, or HTTP/gRPC on loopback)",
        )
    if peer.uid == 0:
        return True
    if opened.memfd_holder is not None and opened.memfd_holder != peer.uid:
        _log_refusal(peer, key, opened)
        raise _denied(key, f"the memfd is held by a process of another user, not {peer.describe()}")
    if opened.acl and st.st_uid != peer.uid:
        _log_refusal(peer, key, opened)
        raise _denied(key, f"it has a POSIX ACL, so only its owner may register it, not {peer.describe()}")
    bits = _bits_for(peer, st)
    if not bits & _READ:
        _log_refusal(peer, key, opened)
        raise _denied(key, f"{peer.describe()} could not open it for reading itself")
    return bool(bits & _WRITE)


def _bits_for(peer: PeerIdentity, st: os.stat_result) -> int:
    """The permission bits the kernel would check for `peer`: owner, else group, else other."""
    if st.st_uid == peer.uid:
        return (st.st_mode >> 6) & 7
    if st.st_gid in peer.groups():
        return (st.st_mode >> 3) & 7
    return st.st_mode & 7


def _servers_own(opened: Opened) -> bool:
    st = opened.st
    if st.st_uid == os.geteuid():
        return True
    if opened.memfd_holder is not None:  # a memfd is rwx for all; only its owner says whose it is
        return False
    return st.st_gid == os.getegid() and bool(st.st_mode & stat.S_IRGRP)


def _denied(key: str, why: str) -> InferenceError:
    return InferenceError(Status.PERMISSION_DENIED, f"shared memory key '{key}' refused: {why}")


def _log_refusal(peer: PeerIdentity | None, key: str, opened: Opened) -> None:
    st = opened.st
    log.warning(
        "shm registration refused key=%s client=%s owner=%d group=%d mode=%04o memfd_holder=%s",
        key,
        peer.describe() if peer is not None else "in-process",
        st.st_uid,
        st.st_gid,
        stat.S_IMODE(st.st_mode),
        opened.memfd_holder,
    )
