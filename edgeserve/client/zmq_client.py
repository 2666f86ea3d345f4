"""Synchronous, pipelined ZeroMQ client: send many requests, collect replies as they complete.

One client per thread (ZeroMQ sockets are not thread-safe); no background thread: replies are
received while you wait on a future, call `poll()`, or iterate `as_completed()`.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq

from edgeserve.client import _core
from edgeserve.client._base import ClientBase, ConnectionOptions, RequestOptions
from edgeserve.client._core import InferResult, InputValue, Outputs, Pending
from edgeserve.client.errors import ClientError
from edgeserve.client.future import ZmqFuture
from edgeserve.client.lane import LaneLink, lane_path
from edgeserve.client.ring import FrameRing, Slot
from edgeserve.client.stream import ZmqStream
from edgeserve.frontends.zmq import wire
from edgeserve.frontends.zmq.endpoint import ipc_path
from edgeserve.frontends.zmq.lane import OP_LANE
from edgeserve.frontends.zmq.spin import CoreShare

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Plain ints: pyzmq's enum constants make `events & POLLIN` an enum operation costing microseconds.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_DONTWAIT = int(zmq.DONTWAIT)
_RCVTIMEO = int(zmq.RCVTIMEO)
_SNDMORE = int(zmq.SNDMORE)
DEFAULT_SPIN_US = 500  # covers a fast model's round trip here (0.2-0.3 ms); slower replies: no spinning


class ZmqClient(ClientBase[tuple[ZmqFuture, Pending | None]]):
    """Client for edgeserve's ZeroMQ frontend, numpy in and numpy out.

    `timeout`, `copy_inputs`, `context` and `identity`: see ClientBase.
    `spin_us`: busy-wait up to that long for a reply before sleeping, while replies have recently
    come within it (a slow model, a busy server or a paced camera turns spinning off by itself),
    yielding the core between polls, and while this thread gets its core when it spins (other busy
    processes on the box turn it off for a while: a yielding thread then waits behind them, where
    a woken one runs at once). Against the server's own spin it adds 0-20% (7% on average here)
    to back-to-back round trips, for a core while it waits. 0 = always sleep.
    `lane`: over an ipc:// endpoint, once a ring is created, requests and replies that fit go over a
    lane (a Unix socket past libzmq's I/O threads, see edgeserve/frontends/zmq/lane.py); False = never.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 10.0,
        *,
        spin_us: int = DEFAULT_SPIN_US,
        lane: bool = True,
        **options: Unpack[ConnectionOptions],
    ) -> None:
        super().__init__(endpoint, timeout, **options)
        self._link = LaneLink(lane_path(path) if lane and (path := ipc_path(self.endpoint)) else None)
        self.spin_s = max(0, spin_us) / 1e6
        self._reply_s = 0.0  # recent send-to-reply time of infer requests (moving average)
        self._core = CoreShare()  # whether this thread gets its core while it spins
        self._deadlines: list[tuple[float, int]] = []
        self._rcvtimeo = -1

    # -- inference ------------------------------------------------------------------------------
    def submit(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Outputs = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> ZmqFuture:
        """Send one request and return at once. `inputs` maps names to numpy arrays (sent inline,
        or copied into a slot of `ring` when given) or to `ShmTensor`s (e.g. `slot.tensor(...)`).
        `outputs`: None (all, inline), a list of names, or {name: None | FrameRing | Slot | ShmTensor}.
        `options`: version, ring, priority, timeout_us, parameters (RequestOptions)."""
        if self._registrations.lost:
            self._register_again()
            self._open_lane()  # a new server: a new lane
        pending, frames = self._request(model, inputs, outputs, options)
        return self._send(pending, frames, timeout)

    def infer(
        self, model: str, inputs: Mapping[str, InputValue], outputs: Outputs = None, **kwargs: Any
    ) -> InferResult:
        """Send one request and wait for its result."""
        result: InferResult = self.submit(model, inputs, outputs, **kwargs).result()
        return result

    def infer_stream(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> ZmqStream:
        """Send a streamed request (a decoupled model's 0..N responses) and return an iterator of its
        results, which stops after the final reply. `timeout`: the longest wait for each response
        (default: the client's); then the request is cancelled and DEADLINE_EXCEEDED raised. Leave a
        `with` block (or call `cancel()`) to stop early: the model sees its request cancelled."""
        if self._registrations.lost:
            self._register_again()
        state, frames = self._stream_request(model, inputs, outputs, options, timeout)
        sock = self._open_socket(state.pending)
        try:
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                wire.sock_send(sock, frame, _SNDMORE if i < last else 0, wire.send_copy(frame))
        except zmq.Again:
            raise self._unreachable(state.pending) from None
        self._streams[state.pending.id] = state
        return ZmqStream(state, self._pump_until, self._send_now)

    def _pump_until(self, until: float) -> None:
        self._pump(self._next_wake(until))

    def _send_now(self, frames: list[Any]) -> None:
        """Send without waiting; a message the socket cannot take now is dropped (the cancel of a
        stream: the request's own deadline ends it then)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(frames, flags=_DONTWAIT)

    def poll(self, timeout: float = 0.0) -> int:
        """Receive the replies that arrive within `timeout` seconds; returns how many futures finished."""
        before = len(self._pending)
        until = time.monotonic() + timeout
        while True:
            self._pump(until)
            if time.monotonic() >= until or self._sock is None:
                return before - len(self._pending)

    def as_completed(self, futures: Iterable[ZmqFuture], timeout: float | None = None) -> Iterator[ZmqFuture]:
        """Yield futures as they finish (each finishes by its own deadline at the latest)."""
        waiting = list(futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            ready = [f for f in waiting if f.done()]
            if ready:
                waiting = [f for f in waiting if not f.done()]
                yield from ready
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(waiting)} request(s) not finished within {timeout} s")
            self._pump(self._next_wake(deadline))

    def acquire_slot(self, ring: FrameRing, timeout: float | None = None) -> Slot:
        """A free slot of `ring`, receiving replies (which free slots) for up to `timeout` seconds
        (default: the client timeout); RingFull if none frees up. For dropping instead of waiting,
        use `ring.try_acquire()`."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            slot = ring.try_acquire()
            if slot is not None:
                return slot
            if time.monotonic() >= deadline or self._sock is None:
                return ring.acquire()  # raises RingFull
            self._pump(min(self._next_wake(None), deadline))

    @property
    def spinning(self) -> bool:
        """Whether waiting for a reply busy-waits first: replies have recently come within `spin_us`,
        and this thread got its core while it spun (other busy processes make a sleeping wait faster)."""
        return self.spin_s > 0.0 and self._reply_s <= self.spin_s and not self._core.backoff

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- control --------------------------------------------------------------------------------
    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call(wire.OP_PING, timeout)

    def is_ready(self, model: str = "", version: str = "") -> bool:
        return bool(self._call(wire.OP_READY, None, model=model, version=version)["ready"])

    def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = self._call(wire.OP_METADATA, None, model=model, version=version)["metadata"]
        return meta

    def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register a POSIX shm object (`key`) as region `name`, owned by this client. If the server
        restarts, the next `submit` after a NOT_FOUND for the region registers it again."""
        self._call(wire.OP_REGISTER, None, name=name, key=key, offset=offset, byte_size=byte_size)
        self._registrations.add(name, key, byte_size, offset)

    def unregister_region(self, name: str = "") -> None:
        """Unregister one of this client's regions ("" = all of them)."""
        self._call(wire.OP_UNREGISTER, None, name=name)
        self._registrations.remove(name)

    def _register_again(self) -> None:
        for fields in self._registrations.take_lost():
            try:
                self._call(wire.OP_REGISTER, None, **fields)
            except ClientError as exc:
                if exc.status != "ALREADY_EXISTS":
                    raise

    def regions(self, name: str = "") -> list[dict[str, Any]]:
        """The regions this client may name (`mine`: registered by it; every region under the server's
        `[shm] registration = "triton"`)."""
        regions: list[dict[str, Any]] = self._call(wire.OP_STATUS, None, name=name)["regions"]
        return regions

    def register_ring(self, ring: FrameRing) -> FrameRing:
        self.register_region(ring.name, ring.key, ring.byte_size)
        return ring

    def create_ring(self, slots: int, slot_size: int, name: str | None = None) -> FrameRing:
        """A new ring, registered with the server and closed (unlinked) with this client."""
        ring = FrameRing(slots, slot_size, name=name)
        while True:
            try:
                self.register_ring(ring)
            except BaseException as exc:
                ring = self._ring_refused(ring, exc, slots, slot_size, name)
                continue
            self._rings.append(ring)
            self._open_lane()
            return ring

    def _open_lane(self) -> None:
        if self._sock is not None and self._link.pending is not None:
            self._link.open(self._sock, self._lane_token, self._owners, self.endpoint, min(self.timeout, 5.0))

    def _lane_token(self) -> bytes:
        return bytes.fromhex(self._call(OP_LANE, None)["token"])

    @property
    def lane_open(self) -> bool:
        """Whether requests go over a lane now."""
        return self._link.lane is not None

    def close(self) -> None:
        """Say bye (the server releases this client's regions), fail what is in flight, unlink rings."""
        if self._sock is None:
            return
        try:
            future = self._send(
                None, _core.build_control(self._take_id(), wire.OP_BYE), min(self.timeout, 1.0)
            )
            future.exception()
        except ClientError:
            pass
        for fut, pending in list(self._pending.values()):
            if pending is not None:
                pending.release_slots()
            fut._set(None, ClientError("UNAVAILABLE", "the client was closed"))
        self._pending.clear()
        self._link.close()
        self._close_socket()

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _call(self, op: str, timeout: float | None, **fields: Any) -> dict[str, Any]:
        header: dict[str, Any] = self._send(
            None, _core.build_control(self._take_id(), op, **fields), timeout
        ).result()
        return header

    def _send(self, pending: Pending | None, frames: list[Any], timeout: float | None) -> ZmqFuture:
        sock = self._open_socket(pending)
        req_id = pending.id if pending is not None else wire.loads(frames[0])["id"]
        lane = self._link.lane
        if lane is None or pending is None or not lane.send(frames):  # a request too big for a packet
            try:
                last = len(frames) - 1
                send = wire.sock_send  # past pyzmq's Python layer; send_multipart costs more still
                for i, frame in enumerate(frames):
                    send(sock, frame, _SNDMORE if i < last else 0, wire.send_copy(frame))
            except zmq.Again:
                raise self._unreachable(pending) from None
        now = time.monotonic()
        deadline = now + (self.timeout if timeout is None else timeout)
        if pending is not None:
            pending.sent_at = time.perf_counter()
            pending.deadline = deadline
        future = ZmqFuture(self._wait_for, req_id)
        self._pending[req_id] = (future, pending)
        heapq.heappush(self._deadlines, (deadline, req_id))
        return future

    def _next_wake(self, limit: float | None) -> float:
        wake = self._deadlines[0][0] if self._deadlines else time.monotonic() + 1.0
        return wake if limit is None else min(wake, limit)

    def _wait_for(self, future: ZmqFuture, timeout: float | None) -> None:
        limit = None if timeout is None else time.monotonic() + timeout
        while not future._done:
            if limit is not None and time.monotonic() >= limit:
                raise TimeoutError(f"request {future.id} not finished within {timeout} s")
            if self._sock is None:
                raise ClientError("UNAVAILABLE", "the client is closed")
            self._pump(self._next_wake(limit), future)

    def _pump(self, until: float, target: ZmqFuture | None = None) -> None:
        """Wait up to `until` for a reply, then take every reply already queued (until `target` is done)."""
        if self._link.lane is not None:
            self._pump_both(until, target)
            return
        sock = self._sock
        assert sock is not None
        wait_ms = max(0, int((until - time.monotonic()) * 1000 + 0.999))
        # Waking up to 1/16 early is harmless (every caller loops) and spares a setsockopt per call.
        if not 0 <= self._rcvtimeo <= wait_ms or wait_ms - self._rcvtimeo > wait_ms >> 4:
            sock.setsockopt(_RCVTIMEO, wait_ms)
            self._rcvtimeo = wait_ms
        recv, get = wire.sock_recv, wire.sock_get
        if self.spin_s > 0.0 and self._reply_s <= self.spin_s and self._core.ready():
            start, cpu_start = time.monotonic(), self._core.cpu_clock()
            end = min(until, start + self.spin_s)
            while not cast(int, get(sock, _EVENTS)) & _POLLIN and time.monotonic() < end:
                # Let a woken thread (ZeroMQ's I/O thread, the server's) have this core now: with
                # EEVDF it may otherwise wait for the rest of our time slice (p99 0.74 -> 0.33 ms).
                os.sched_yield()
            self._core.record(time.monotonic() - start, cpu_start)
        try:
            frame = recv(sock, 0, False)  # one call: no poll first
        except zmq.Again:
            frame = None
        while frame is not None:
            msg = [frame]
            while frame.more:  # the parts of a message arrive together
                frame = recv(sock, 0, False)
                msg.append(frame)
            self._dispatch(msg)
            if (target is not None and target._done) or self._sock is None:
                break
            if not cast(int, get(sock, _EVENTS)) & _POLLIN:
                break
            frame = recv(sock, _DONTWAIT, False)
        heap = self._deadlines
        if heap and (heap[0][1] not in self._pending or heap[0][0] <= time.monotonic()):
            self._expire(time.monotonic())

    def _pump_both(self, until: float, target: ZmqFuture | None) -> None:
        """`_pump` with a lane: replies come over it or (too big for a packet, control) over ZeroMQ."""
        caught = False
        if self.spin_s > 0.0 and self._reply_s <= self.spin_s:
            caught = self._take_both(target)
            if not caught and self._link.lane is not None and self._core.ready():
                start, cpu_start = time.monotonic(), self._core.cpu_clock()
                end = min(until, start + self.spin_s)
                while not caught and time.monotonic() < end:
                    os.sched_yield()  # as in _pump: a woken thread gets this core now
                    caught = self._take_both(target)
                self._core.record(time.monotonic() - start, cpu_start)
        # Not spinning: no look before the wait, which returns at once for a reply already there
        # (a look that finds nothing costs a failed recv on the lane and a ZeroMQ EVENTS query).
        if not caught and self._link.lane is not None:
            self._link.wait(max(0, int((until - time.monotonic()) * 1000 + 0.999)))
            self._take_both(target)
        heap = self._deadlines
        if heap and (heap[0][1] not in self._pending or heap[0][0] <= time.monotonic()):
            self._expire(time.monotonic())

    def _take_both(self, target: ZmqFuture | None) -> bool:
        """Dispatch the replies waiting on the lane and the socket; True when any was."""
        return self._link.take(
            self._sock, self._dispatch, lambda: (target is not None and target._done) or self._sock is None
        )

    def _dispatch(self, msg: list[Any]) -> None:
        answered = self._answered(msg)
        if answered is None:
            return
        header, (future, pending) = answered
        try:
            result, error = self._outcome(header, msg[1:], pending)
            if error is None and pending is not None:
                self._reply_s += (result.latency_s - self._reply_s) * 0.125
            future._set(result, error)
        finally:
            if pending is not None:
                pending.release_slots()

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and (heap[0][1] not in self._pending or heap[0][0] <= now):
            _, req_id = heapq.heappop(heap)
            entry = self._pending.pop(req_id, None)
            if entry is None:
                continue
            future, pending = entry
            future._set(None, self._timed_out(req_id, pending))
