"""The client's end of a lane (edgeserve/frontends/zmq/lane.py): requests and replies over one Unix
SEQPACKET connection to the server, past libzmq's I/O threads, for a client of an ipc:// endpoint.

Opened with a one-time token the server gave over the ZeroMQ socket, which stays for everything
else; the server's end must belong to the server's user (the same check as every ZeroMQ reply's).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import zmq

from edgeserve.client.endpoint import foreign_peer
from edgeserve.client.errors import ClientError
from edgeserve.frontends.zmq import wire
from edgeserve.frontends.zmq.lane import LANE_SUFFIX, PACKET_MAX, decode, encode

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
READ_BATCH = 64  # packets taken per call before the caller looks at its other socket
_EVENTS, _POLLIN, _DONTWAIT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.DONTWAIT)  # ints: no enum math


class HeaderFrame:
    """A reply's first frame as the client reads a ZeroMQ one (`.buffer`; no Peer-Address: the
    lane's server was checked when it connected)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return bytes(self.buffer)

    def get(self, name: str) -> str:
        raise KeyError(name)


def lane_path(socket_path: Path) -> Path:
    return Path(str(socket_path) + LANE_SUFFIX)


class ClientLane:
    """Connected and bound (the token accepted) or ClientError / OSError."""

    def __init__(
        self, path: Path, token: bytes, owners: frozenset[int] | None, endpoint: str, timeout: float
    ) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(str(path))
            if owners is not None:
                pid, uid, gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
                refused = foreign_peer(f"localhost:{uid}:{gid}:{pid}", owners, endpoint)
                if refused is not None:
                    raise ClientError("PERMISSION_DENIED", refused.replace("a reply", "the lane"))
            buffers = encode([token])
            assert buffers is not None
            sock.sendmsg(buffers)
            answer = sock.recv(PACKET_MAX)
            if not answer or [bytes(f) for f in decode(memoryview(answer))] != [b"ok"]:
                raise ClientError("UNAVAILABLE", f"the server closed the lane at {path}")
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket | None = sock
        self._buffer = bytearray(PACKET_MAX + 1)

    def fileno(self) -> int:
        return -1 if self.sock is None else self.sock.fileno()

    def send(self, frames: Sequence[Any]) -> bool:
        """The whole request or nothing, without blocking: False when it does not fit a packet or
        the lane is full (send it over ZeroMQ), or the lane is gone (closed here)."""
        sock = self.sock
        buffers = encode(frames) if sock is not None else None
        if sock is None or buffers is None:
            return False
        try:
            sock.sendmsg(buffers)
        except BlockingIOError:
            return False
        except OSError:
            self.close()
            return False
        return True

    def recv(self) -> list[Any] | None:
        """One reply (its header as a HeaderFrame, then the tensor frames), None when none is
        waiting; ConnectionError when the server closed the lane (closed here too)."""
        sock = self.sock
        if sock is None:
            raise ConnectionError("the lane is closed")
        try:
            size = sock.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self.close()
            raise ConnectionError(f"the lane failed: {exc}") from None
        if size == 0 or size > PACKET_MAX:
            self.close()
            raise ConnectionError("the server closed the lane")
        try:
            # its own bytes (one copy): the outputs are views of it
            frames: list[Any] = decode(memoryview(memoryview(self._buffer)[:size].tobytes()))
        except ValueError as exc:
            self.close()
            raise ConnectionError(f"malformed packet on the lane: {exc}") from None
        frames[0] = HeaderFrame(frames[0])
        return frames

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class LaneLink:
    """A sync client's lane: where to open one, the open one, and a poller over it and the client's
    ZeroMQ socket (replies come over either: too big for a packet, or not asked on the lane)."""

    def __init__(self, path: Path | None) -> None:
        self.at = path
        self.pending = path  # to open at the next chance (a ring; after a server restart)
        self.lane: ClientLane | None = None
        self.poller: zmq.Poller | None = None

    def open(
        self, sock: Any, token: Callable[[], bytes], owners: frozenset[int] | None, endpoint: str,
        timeout: float,
    ) -> None:  # fmt: skip
        """Once per chance, where the server offers one (else, and on any failure, ZeroMQ carries all)."""
        path, self.pending = self.pending, None
        if path is None or self.lane is not None:
            return
        try:
            lane = ClientLane(path, token(), owners, endpoint, timeout)
        except (ClientError, OSError, ValueError, KeyError, TypeError):
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(lane.fileno(), zmq.POLLIN)
        self.lane, self.poller = lane, poller

    def close(self, again: bool = False) -> None:
        """`again`: the server went; open a new lane at the next chance."""
        lane, self.lane, self.poller = self.lane, None, None
        if lane is not None:
            lane.close()
        if again:
            self.pending = self.at

    def wait(self, timeout_ms: int) -> None:
        if self.poller is not None:
            self.poller.poll(timeout_ms)

    def take(self, sock: Any, dispatch: Callable[[list[Any]], None], done: Callable[[], bool]) -> bool:
        """Dispatch the replies waiting on the lane, then on the socket (bounded; stops once `done()`);
        True when there were any."""
        took = False
        for _ in range(READ_BATCH):
            lane = self.lane
            try:
                msg = lane.recv() if lane is not None else None
            except ConnectionError:  # the server went: ZeroMQ until its next start's re-registration
                self.close(again=True)
                break
            if msg is None:
                break
            took = True
            dispatch(msg)
            if done():
                return True
        recv, get = wire.sock_recv, wire.sock_get
        for _ in range(READ_BATCH):
            if sock is None or not cast(int, get(sock, _EVENTS)) & _POLLIN:
                break
            frame = recv(sock, _DONTWAIT, False)
            msg = [frame]
            while frame.more:
                frame = recv(sock, 0, False)
                msg.append(frame)
            took = True
            dispatch(msg)
            if done():
                break
        return took
