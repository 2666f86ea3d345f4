"""The lane: a local client's requests and replies over one Unix SEQPACKET connection, next to the
ZeroMQ ipc:// socket, past libzmq's I/O threads.

Why: over ZeroMQ a request wakes four threads in turn (the client's I/O thread, the server's I/O
thread, the server's ROUTER thread; the reply the same back), and each wake-up on a busy 2-vCPU box
waits for a core: a 200-byte ping-pong between two processes took 100-120 µs p50 over ipc:// and
16 µs over a SEQPACKET socket here (load average 14). With the lane the client's send wakes the
ROUTER thread itself, and the worker's send wakes the client.

How a client gets one (wire README "lane"): it asks over its ZeroMQ socket (`op: "lane"`) and gets
a one-time token (16 random bytes, LANE_TOKEN_TTL_S to use it), connects to `<ipc socket>.lane`
(same folder, same mode as the ipc socket: who may connect is unchanged) and sends the token as its
first packet. The lane is then that ZeroMQ socket's, as its user: the kernel's SO_PEERCRED of the
connection must name the user the ZeroMQ message that asked for the token came from, or the lane is
closed. Requests on it are handled exactly as on the ZeroMQ socket (same owner for shared memory,
same in-flight limit), as the lane's user (SO_PEERCRED). Only the replies to the requests that came
over the lane go back over it (by request id), and only one that fits a packet (PACKET_MAX); every
other reply (a streamed request's, one too big) goes over ZeroMQ, as without a lane: a lane never
carries anything that was not asked for on it, whoever holds its routing id on the socket. (What is
left: a process holding another user's routing id, 16 random bytes never shown to anyone else, that
sends a request with an id that user's socket has in flight gets that one reply; over ZeroMQ alone
the holder of a routing id gets every reply to it while it holds it.)

Packets: u16 frame count, u32 length per frame, the frames (the ZeroMQ message's frames after the
routing envelope). Every loop is bounded; all sends are non-blocking (a full lane is a dead lane).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgeserve.frontends.shm.binding import PeerIdentity, principal_of
from edgeserve.frontends.zmq import wire
from edgeserve.frontends.zmq.ipc import bind_ipc

log = logging.getLogger("edgeserve.zmq")

OP_LANE = "lane"  # the control op that hands out a token (wire README)
LANE_SUFFIX = ".lane"
PACKET_MAX = 128 * 1024  # fits the default socket buffers (net.core.wmem_default 208 KiB)
COUNT = struct.Struct("<H")
LENGTH = struct.Struct("<I")
FRAMES_MAX = 64
TOKEN_TTL_S = 10.0
TOKENS_MAX = 256  # tokens not yet used (oldest dropped first)
UNBOUND_MAX = 16  # connections that have not shown a token yet (oldest closed first)
LANES_PER_CLIENT = 4  # bound lanes of one client socket (its oldest closed first)
LANES_MAX = 256  # bound lanes in all, as many as [zmq] max_clients' default (more are refused)
BACKLOG = 16
IDS_MAX = 65536  # request ids awaiting their reply on one lane (far above [zmq] max_inflight_per_client)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
ID_UNKNOWN: Any = object()  # a reply whose request id the sender did not say: read from its header


# The whole head of a packet of n frames (count, n lengths) packed or read in one call, per n.
_HEADS = [struct.Struct(f"<H{n}I") for n in range(FRAMES_MAX + 1)]
_LENGTHS = [struct.Struct(f"<{n}I") for n in range(FRAMES_MAX + 1)]


def encode(frames: Sequence[Any]) -> list[Any] | None:
    """The buffers of one packet (for sendmsg: gathered by the kernel, no copy here); None when it
    would not fit PACKET_MAX or has too many frames."""
    count = len(frames)
    if count > FRAMES_MAX:
        return None
    sizes = [memoryview(frame).nbytes for frame in frames]
    head = _HEADS[count]
    if head.size + sum(sizes) > PACKET_MAX:
        return None
    return [head.pack(count, *sizes), *frames]


def decode(packet: memoryview) -> list[memoryview]:
    """The frames of a packet; ValueError for a malformed one."""
    if len(packet) < COUNT.size:
        raise ValueError("short packet")
    (count,) = COUNT.unpack_from(packet, 0)
    if not 0 < count <= FRAMES_MAX:
        raise ValueError(f"{count} frames")
    lengths = _LENGTHS[count]
    at = COUNT.size + lengths.size
    if at > len(packet):
        raise ValueError("short packet")
    frames = []
    for size in lengths.unpack_from(packet, COUNT.size):
        frames.append(packet[at : at + size])
        at += size
    if at != len(packet):
        raise ValueError("frame lengths do not add up to the packet")
    return frames


def peer_credentials(sock: socket.socket) -> PeerIdentity:
    """The connecting process as the kernel tells (SO_PEERCRED: fixed at connect)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return PeerIdentity("lane", "ipc", uid, gid, pid or None)


def send_packet(sock: socket.socket, frames: Sequence[Any]) -> bool:
    """One packet, non-blocking; False when it does not fit, the lane is full or gone."""
    buffers = encode(frames)
    if buffers is None:
        return False
    try:
        sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


class LaneFrame:
    """A lane packet's frame as the frontend reads a ZeroMQ one: `.buffer`, `.bytes`, `len()` and the
    Peer-Address libzmq would give an ipc peer (its user as SO_PEERCRED says), so a lane's message is
    handled by the very code that handles the socket's."""

    __slots__ = ("address", "buffer")

    def __init__(self, buffer: Any, address: str) -> None:
        self.buffer = buffer
        self.address = address

    @property
    def bytes(self) -> bytes:
        return bytes(self.buffer)

    def __len__(self) -> int:
        return len(self.buffer)

    def get(self, name: str) -> str:
        if name != "Peer-Address":
            raise KeyError(name)
        return self.address


def lane_message(lane: Lane, frames: list[memoryview]) -> list[LaneFrame]:
    """A bound lane's packet as the ROUTER socket would have received it: routing id first."""
    head = lane.ident_frame
    assert head is not None
    address = lane.address
    return [head, *[LaneFrame(f, address) for f in frames]]


class Lane:
    """One accepted connection: unbound until it shows a token, then a ZeroMQ socket's (`ident`)."""

    __slots__ = ("address", "closed", "fd", "ident", "ident_frame", "identity", "ids", "opened", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.identity = peer_credentials(sock)
        who = self.identity
        self.address = f"localhost:{who.uid}:{who.gid}:{who.pid or 0}"  # as libzmq's for ipc peers
        self.ident: bytes | None = None  # the ZeroMQ routing id it acts for, once bound
        self.ident_frame: LaneFrame | None = None  # that id as the first frame of each of its messages
        self.opened = time.monotonic()
        self.closed = False
        self.ids: set[int | str] = set()  # requests that came over it, not answered yet

    def asked(self, fields: Any) -> None:
        """A request came over the lane (`fields`: its header as the frontend parsed it, once): its
        reply goes back over it (a streamed one's: ZeroMQ)."""
        req_id = fields.get("id") if isinstance(fields, dict) and fields.get("stream") is not True else None
        if isinstance(req_id, (int, str)) and not isinstance(req_id, bool):
            if len(self.ids) >= IDS_MAX:  # replies lost on the way: ZeroMQ carries the rest
                self.ids.clear()
            self.ids.add(req_id)

    def reply(self, frames: Sequence[Any], req_id: Any = ID_UNKNOWN) -> bool:
        """Any thread: send a reply (header frame first) if it answers a request of this lane.
        `req_id`: the id its header carries, when the sender knows it (no parse of the header)."""
        try:
            if req_id is ID_UNKNOWN:
                req_id = wire.loads(frames[0]).get("id")
            self.ids.remove(req_id)
        except (ValueError, AttributeError, TypeError, KeyError):
            return False
        return self.send(frames)

    def send(self, frames: Sequence[Any]) -> bool:
        """Any thread: the whole reply or nothing (SEQPACKET sends are atomic)."""
        return not self.closed and send_packet(self.sock, frames)


class Lanes:
    """The listening socket, the tokens handed out and the open lanes. Everything but `Lane.send` and
    `issue` runs on the ROUTER thread (`watch` registers fds with its poll loop)."""

    def __init__(
        self,
        endpoint: str,
        path: Path,
        watch: Callable[[int, Callable[[], int] | None], None],
        route: Callable[[bytes, Callable[[list[Any], Any], bool] | None], None],
        on_packet: Callable[[Lane, list[memoryview]], None],
    ) -> None:
        self.path = Path(str(path) + LANE_SUFFIX)
        self._watch = watch
        self._route = route
        self._on_packet = on_packet
        self._tokens: dict[bytes, tuple[bytes, str, float]] = {}  # token -> ident, principal, issued
        self._tokens_lock = threading.Lock()
        self._lanes: dict[int, Lane] = {}  # by fd
        self._buffer = bytearray(PACKET_MAX + 1)  # one more byte: an oversized packet shows as such
        self.requests = 0  # packets handled on bound lanes
        self.refused = 0  # connections closed for a missing, wrong or foreign token
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)

        def bind(address: str) -> None:
            listener.bind(address[len("ipc://") :])
            listener.listen(BACKLOG)

        try:
            bind_ipc(bind, endpoint + LANE_SUFFIX, self.path, default=False)  # the folder is checked
        except BaseException:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener: socket.socket | None = listener

    def start(self) -> None:
        """On the ROUTER thread."""
        if self._listener is not None:
            self._watch(self._listener.fileno(), self._accept)

    def issue(self, ident: bytes, principal: str) -> bytes:
        """A one-time token for the ZeroMQ socket `ident` whose message came from `principal`."""
        token = secrets.token_bytes(16)
        now = time.monotonic()
        with self._tokens_lock:
            for old in [t for t, (_, _, at) in self._tokens.items() if now - at > TOKEN_TTL_S]:
                del self._tokens[old]
            while len(self._tokens) >= TOKENS_MAX:
                del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = (ident, principal, now)
        return token

    def _take(self, token: bytes) -> tuple[bytes, str] | None:
        with self._tokens_lock:
            entry = self._tokens.pop(token, None)
        if entry is None or time.monotonic() - entry[2] > TOKEN_TTL_S:
            return None
        return entry[0], entry[1]

    def _accept(self) -> int:
        listener = self._listener
        for _ in range(BACKLOG):  # bounded: the poll loop comes back for more
            if listener is None:
                return 0
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return 0
            except OSError as exc:  # EMFILE and the like: log, the loop goes on
                log.warning("zmq lane: accept failed: %s", exc)
                return 0
            sock.setblocking(False)
            try:
                lane = Lane(sock)
            except OSError:
                sock.close()
                continue
            unbound = [lane for lane in self._lanes.values() if lane.ident is None]
            if len(unbound) >= UNBOUND_MAX:  # connections that never show a token hold no more fds
                self.close_lane(min(unbound, key=lambda each: each.opened))
            self._lanes[lane.fd] = lane
            self._watch(lane.fd, functools.partial(self._readable, lane))
        return 0

    def _readable(self, lane: Lane) -> int:
        """Handle what the lane holds (bounded); returns how many requests."""
        buffer = self._buffer
        handled = 0
        for _ in range(64):  # bounded: other lanes and the ZeroMQ socket get their turn
            if lane.closed:
                break
            try:
                size = lane.sock.recv_into(buffer, len(buffer), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                size = 0
            if size == 0 or size > PACKET_MAX:  # gone, or a packet past the limit: the lane goes
                self.close_lane(lane)
                break
            try:
                # its own bytes (one copy): a request's views outlive the buffer
                frames = decode(memoryview(memoryview(buffer)[:size].tobytes()))
            except ValueError:
                self.close_lane(lane)
                break
            if lane.ident is None:
                self._bind(lane, frames)
                continue
            self.requests += 1
            handled += 1
            self._on_packet(lane, frames)  # which calls lane.asked with the header it parsed
        return handled

    def _bind(self, lane: Lane, frames: list[memoryview]) -> None:
        """The first packet: the token, as the one frame. A lane whose user is not the user that asked
        for the token (or with no token, a stale or a used one) is closed, answered nothing."""
        entry = self._take(bytes(frames[0])) if len(frames) == 1 else None
        if entry is None or principal_of(lane.identity) != entry[1]:
            self.refused += 1
            log.warning(
                "zmq lane: closed a connection of %s: %s", lane.identity.describe(),
                "no valid token" if entry is None else "its user is not the one the token was issued to",
            )  # fmt: skip
            self.close_lane(lane)
            return
        mine = [other for other in self._lanes.values() if other.ident == entry[0]]
        if len(mine) >= LANES_PER_CLIENT:  # fds stay bounded: a client that reconnects keeps its newest
            self.close_lane(min(mine, key=lambda each: each.opened))
        if self.open >= LANES_MAX:
            self.refused += 1
            log.warning("zmq lane: %d lanes open, refused one of %s", LANES_MAX, lane.identity.describe())
            self.close_lane(lane)
            return
        lane.ident = entry[0]
        lane.ident_frame = LaneFrame(lane.ident, lane.address)
        if not lane.send([b"ok"]):
            self.close_lane(lane)
            return
        self._route(lane.ident, lane.reply)

    def drop(self, ident: bytes) -> None:
        """The ZeroMQ socket `ident` is gone: so are its lanes (ROUTER thread)."""
        for lane in [lane for lane in self._lanes.values() if lane.ident == ident]:
            self.close_lane(lane)

    def close_lane(self, lane: Lane) -> None:
        if lane.closed:
            return
        lane.closed = True
        self._lanes.pop(lane.fd, None)
        if lane.ident is not None and not any(other.ident == lane.ident for other in self._lanes.values()):
            self._route(lane.ident, None)
        self._watch(lane.fd, None)
        with contextlib.suppress(OSError):
            lane.sock.shutdown(socket.SHUT_RDWR)
        lane.sock.close()

    @property
    def open(self) -> int:
        return sum(1 for lane in self._lanes.values() if lane.ident is not None)

    def close(self) -> None:
        """After the ROUTER thread stopped."""
        for lane in list(self._lanes.values()):
            self.close_lane(lane)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
