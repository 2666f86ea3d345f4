"""Who is on the other end of a client connection: the local user behind it, when that can be known.

Used where the answer changes what a client may do (shared memory registration: a local client may
register only memory it could open itself). Sources, each one the kernel's word, never the client's:
- ZeroMQ over ipc: the `Peer-Address` property libzmq attaches to every message,
  "localhost:<uid>:<gid>:<pid>" from SO_PEERCRED at connect time. A peer can send its own
  "Peer-Address" in its ZMTP handshake metadata, which libzmq keeps only when it computed none itself,
  so the value is trusted only after `zmq_peer_credentials_work` saw libzmq compute it here.
- HTTP on a Unix socket: SO_PEERCRED of the connection's socket.
- HTTP/gRPC from a loopback address: the owner of the client's socket, the `uid` column of the
  /proc/net/tcp{,6} row whose local end is the peer's address and port (and whose remote end is the
  server's port). Every matching row must agree, so a second socket bound to the same port (SO_REUSEADDR)
  cannot lend its owner to the client; TIME_WAIT rows (uid 0, no inode) never count.
- Anything else (a LAN peer, ZeroMQ over tcp, gRPC on a Unix socket, a lookup that failed) has no
  known user.
The answer, a PeerIdentity, is defined beside the shared-memory binding that it decides (shm/binding.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import struct
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.frontends.shm.binding import PeerIdentity

log = logging.getLogger("edgeserve.peer")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_TCP_ESTABLISHED = 0x01
_ZMQ_IPC_PEER = re.compile(r"localhost:([0-9]{1,10}):([0-9]{1,10}):([0-9]{1,10})")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


# -- ZeroMQ ---------------------------------------------------------------------------------------
def zmq_peer(frame: Any, credentials_work: bool) -> PeerIdentity:
    """The peer that sent `frame` (a pyzmq Frame received with copy=False)."""
    try:
        address = str(frame.get("Peer-Address"))
    except Exception:  # no metadata on this message
        return PeerIdentity("zmq", "")
    match = _ZMQ_IPC_PEER.fullmatch(address)
    if match is None:
        return PeerIdentity("zmq-tcp", address)
    if not credentials_work:
        return PeerIdentity("zmq-ipc", "ipc")
    uid, gid, pid = (int(group) for group in match.groups())
    return PeerIdentity("zmq-ipc", "ipc", uid, gid, pid or None)


def zmq_peer_credentials_work() -> bool:
    """Whether this libzmq reports SO_PEERCRED for ipc peers (glibc's getnameinfo names a Unix peer
    "localhost"; where it cannot, libzmq computes no Peer-Address and a peer could send its own)."""
    import zmq

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    server.linger = client.linger = 0
    try:
        with tempfile.TemporaryDirectory(prefix="edgeserve-peercred-") as folder:
            endpoint = f"ipc://{folder}/probe"
            server.bind(endpoint)
            client.connect(endpoint)
            client.send(b"probe")
            if not server.poll(5000):
                return False
            frames = server.recv_multipart(copy=False)
            expected = f"localhost:{os.geteuid()}:{os.getegid()}:{os.getpid()}"
            return str(frames[-1].get("Peer-Address")) == expected
    except (zmq.ZMQError, OSError) as exc:
        log.warning("cannot check whether libzmq reports ipc peer credentials: %s", exc)
        return False
    finally:
        client.close(0)
        server.close(0)
        ctx.term()


# -- sockets --------------------------------------------------------------------------------------
def socket_peer(sock: Any, server_port: int | None = None, proc_root: Path = Path("/proc")) -> PeerIdentity:
    """The peer of a connected socket (an asyncio transport's "socket" extra info)."""
    if sock is None:
        return PeerIdentity("unknown", "")
    try:
        family = sock.family
        if family == socket.AF_UNIX:
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            return PeerIdentity("unix", "unix", uid, gid, pid or None, proc_root)
        peer = sock.getpeername()
        local = sock.getsockname()
    except (OSError, ValueError, struct.error):
        return PeerIdentity("unknown", "")
    return tcp_peer(str(peer[0]), int(peer[1]), server_port or int(local[1]), proc_root)


_TRANSPORT_PEERS: weakref.WeakKeyDictionary[Any, PeerIdentity] = weakref.WeakKeyDictionary()


def transport_peer(transport: Any) -> PeerIdentity:
    """The peer of an asyncio transport (an aiohttp connection), looked up once per connection: the
    owner of a socket, like SO_PEERCRED, is fixed when it connects."""
    if transport is None:
        return PeerIdentity("unknown", "")
    known = _TRANSPORT_PEERS.get(transport)
    if known is None:
        known = _TRANSPORT_PEERS[transport] = socket_peer(transport.get_extra_info("socket"))
    return known


def grpc_peer(peer: str, server_port: int | None, proc_root: Path = Path("/proc")) -> PeerIdentity:
    """From grpc's `context.peer()`: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:..."."""
    from edgeserve.frontends.grpc.auth import peer_host

    host = peer_host(peer)
    port = peer.rpartition(":")[2]
    if host is None or not port.isdigit():
        return PeerIdentity("grpc", peer)
    return tcp_peer(host, int(port), server_port, proc_root)


def tcp_peer(host: str, port: int, server_port: int | None, proc_root: Path = Path("/proc")) -> PeerIdentity:
    """A TCP peer; its user when it connects from loopback (the owner of its socket)."""
    address = f"{host}:{port}"
    try:
        ip = _plain(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        return PeerIdentity("tcp", address)
    if not ip.is_loopback:
        return PeerIdentity("tcp", address)
    uid = tcp_socket_owner(ip, port, server_port, proc_root)
    return PeerIdentity("tcp-loopback", address, uid, None, None, proc_root)


def tcp_socket_owner(ip: IpAddress, port: int, server_port: int | None, proc_root: Path) -> int | None:
    """The uid owning the established socket whose local end is ip:port (connected to `server_port`
    when given); None when no row, or rows that disagree, match."""
    owners: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_root / "net" / name).read_text()
        except OSError:
            continue
        for row in parse_proc_net_tcp(text, port):
            if row.state != _TCP_ESTABLISHED or not row.inode or row.local != (ip, port):
                continue
            if server_port is not None and row.remote[1] != server_port:
                continue
            owners.add(row.uid)
    if len(owners) != 1:
        if owners:
            log.warning("sockets of several users share %s:%d; its client counts as unknown", ip, port)
        return None
    return owners.pop()


@dataclass(frozen=True, slots=True)
class TcpRow:
    local: tuple[IpAddress, int]
    remote: tuple[IpAddress, int]
    state: int
    uid: int
    inode: int


def parse_proc_net_tcp(text: str, local_port: int | None = None) -> Iterator[TcpRow]:
    """The rows of /proc/net/tcp or /proc/net/tcp6 (addresses as the kernel prints them: 32-bit words
    in host byte order; IPv4-mapped IPv6 addresses come back as IPv4); with `local_port`, only rows of
    that local port (a box may hold thousands of sockets: the others are not decoded)."""
    port = None if local_port is None else f":{local_port:04X}"
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or (port is not None and not parts[1].endswith(port)):
            continue
        with contextlib.suppress(ValueError, struct.error):
            yield TcpRow(
                _endpoint(parts[1]), _endpoint(parts[2]), int(parts[3], 16), int(parts[7]), int(parts[9])
            )


def _endpoint(text: str) -> tuple[IpAddress, int]:
    hex_ip, _, hex_port = text.partition(":")
    words = [int(hex_ip[i : i + 8], 16) for i in range(0, len(hex_ip), 8)]
    raw = struct.pack(f"={len(words)}I", *words)
    ip: IpAddress = ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw)
    return _plain(ip), int(hex_port, 16)


def _plain(ip: IpAddress) -> IpAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
