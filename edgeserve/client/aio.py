"""asyncio ZeroMQ client: `await client.infer(...)`, or `await client.submit(...)` for pipelining.

The socket is a plain (non-asyncio) DEALER watched with `loop.add_reader` on its ZMQ_FD: sends are
non-blocking calls and replies are drained by one callback, with none of zmq.asyncio's per-message
futures (a quarter of the client's CPU on a small model's round trip). ZMQ_FD is edge-triggered:
after every send the socket's EVENTS are checked for replies that arrived meanwhile.

`submit_now` / `submit_to` take a callback instead of returning a future, for a caller that acts on
every reply at once (a camera pipeline): it runs inside the socket's reader callback with the ring
outputs as views (no copy), which saves the future, a turn of the event loop and a copy per reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import zmq

from edgeserve.client import _core
from edgeserve.client._base import ClientBase, RequestOptions
from edgeserve.client._core import InferResult, InputValue, Outputs, Pending
from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing
from edgeserve.client.stream import AsyncZmqStream, StreamState
from edgeserve.client.zmq_client import _EVENTS, _POLLIN
from edgeserve.frontends.zmq import wire

if TYPE_CHECKING:
    from typing_extensions import Unpack

_SEND_RETRY_S = 0.001
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
log = logging.getLogger("edgeserve.client")

# (result, None) or (None, error); the result's ring outputs are views, valid during the call only
Reply = Callable[[InferResult | None, ClientError | None], object]
Target = asyncio.Future[Any] | Reply  # what a reply completes


class AsyncZmqClient(ClientBase[tuple[Target, Pending | None, asyncio.TimerHandle]]):
    """The asyncio twin of `ZmqClient`; use it from one event loop. The constructor's arguments:
    see ClientBase."""

    _loop: asyncio.AbstractEventLoop | None = None  # where the socket's reader is installed

    # -- inference ------------------------------------------------------------------------------
    async def submit(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Outputs = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> asyncio.Future[InferResult]:
        """Send one request; returns a future of its result (same arguments as `ZmqClient.submit`)."""
        if self._registrations.lost:
            await self._register_again()
        pending, frames = self._request(model, inputs, outputs, options)
        return await self._send(pending, frames, timeout)

    def submit_now(
        self,
        on_reply: Reply,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Outputs = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> bool:
        """Send one request without waiting, its reply to `on_reply` (see the module's docstring);
        False, with nothing sent or taken, when that needs a wait (no server connected, the send
        queue full, regions to register again): `submit_to` then waits for it."""
        sock = self._sock
        if sock is None or not self.submit_ready():
            return False
        pending, frames = self._request(model, inputs, outputs, options)
        self._track(pending.id, pending, on_reply, self.timeout if timeout is None else timeout)
        try:
            sock.send_multipart(frames, flags=_NOBLOCK, copy=False)  # POLLOUT: it cannot block
        except zmq.ZMQError:
            self._untrack(pending.id)
            raise self._unreachable(pending) from None
        self._after_send(sock)
        return True

    def submit_ready(self) -> bool:
        """Whether `submit_now` would send now."""
        sock = self._sock
        return (
            sock is not None
            and self._loop is not None
            and not self._registrations.lost
            and bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLOUT)
        )

    async def submit_to(
        self,
        on_reply: Reply,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Outputs = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> None:
        """`submit_now` that waits for the socket (as `submit` does) instead of returning False."""
        if self._registrations.lost:
            await self._register_again()
        pending, frames = self._request(model, inputs, outputs, options)
        await self._send(pending, frames, timeout, on_reply)

    async def infer(
        self, model: str, inputs: Mapping[str, InputValue], outputs: Outputs = None, **kwargs: Any
    ) -> InferResult:
        future = await self.submit(model, inputs, outputs, **kwargs)
        return await future

    def infer_stream(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncZmqStream:
        """`async for result in client.infer_stream(...)`: a streamed request's results, as
        `ZmqClient.infer_stream` (sent on the first iteration, or by `async with`)."""
        state, frames = self._stream_request(model, inputs, outputs, options, timeout)
        return AsyncZmqStream(state, lambda: self._send_stream(state, frames), self._send_now)

    async def _send_stream(self, state: StreamState, frames: list[Any]) -> None:
        if self._registrations.lost:
            await self._register_again()
        sock = self._open_socket(state.pending)
        self._watch(sock)
        self._streams[state.pending.id] = state
        try:
            await self._send_frames(sock, frames, time.monotonic() + state.timeout)
        except zmq.Again:
            self._streams.pop(state.pending.id, None)
            raise self._unreachable(state.pending) from None

    def _send_now(self, frames: list[Any]) -> None:
        """Send without waiting; dropped when the socket cannot take it now (a stream's cancel: the
        request's own deadline ends it then)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(frames, flags=_NOBLOCK)

    # -- control --------------------------------------------------------------------------------
    async def ping(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(wire.OP_PING, timeout)

    async def is_ready(self, model: str = "", version: str = "") -> bool:
        return bool((await self._call(wire.OP_READY, None, model=model, version=version))["ready"])

    async def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = (await self._call(wire.OP_METADATA, None, model=model, version=version))[
            "metadata"
        ]
        return meta

    async def register_region(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        await self._call(wire.OP_REGISTER, None, name=name, key=key, offset=offset, byte_size=byte_size)
        self._registrations.add(name, key, byte_size, offset)

    async def unregister_region(self, name: str = "") -> None:
        await self._call(wire.OP_UNREGISTER, None, name=name)
        self._registrations.remove(name)

    async def _register_again(self) -> None:
        for fields in self._registrations.take_lost():
            try:
                await self._call(wire.OP_REGISTER, None, **fields)
            except ClientError as exc:
                if exc.status != "ALREADY_EXISTS":
                    raise

    async def regions(self, name: str = "") -> list[dict[str, Any]]:
        regions: list[dict[str, Any]] = (await self._call(wire.OP_STATUS, None, name=name))["regions"]
        return regions

    async def register_ring(self, ring: FrameRing) -> FrameRing:
        await self.register_region(ring.name, ring.key, ring.byte_size)
        return ring

    async def create_ring(self, slots: int, slot_size: int, name: str | None = None) -> FrameRing:
        ring = FrameRing(slots, slot_size, name=name)
        while True:
            try:
                await self.register_ring(ring)
            except BaseException as exc:
                ring = self._ring_refused(ring, exc, slots, slot_size, name)
                continue
            self._rings.append(ring)
            return ring

    async def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(ClientError, asyncio.TimeoutError):
            await self._call(wire.OP_BYE, min(self.timeout, 1.0))
        entries = list(self._pending.values())
        self._pending.clear()
        for target, pending, timer in entries:
            timer.cancel()
            self._complete(target, pending, None, ClientError("UNAVAILABLE", "the client was closed"))
        if self._loop is not None:
            with contextlib.suppress(Exception):  # a closed loop has nothing to remove
                self._loop.remove_reader(cast(int, self._sock.getsockopt(zmq.FD)))
            self._loop = None
        self._close_socket()

    async def __aenter__(self) -> AsyncZmqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------
    async def _call(self, op: str, timeout: float | None, **fields: Any) -> dict[str, Any]:
        future = await self._send(None, _core.build_control(self._take_id(), op, **fields), timeout)
        header: dict[str, Any] = await future
        return header

    async def _send(
        self, pending: Pending | None, frames: list[Any], timeout: float | None, on_reply: Reply | None = None
    ) -> asyncio.Future[Any]:
        sock = self._open_socket(pending)
        loop = self._watch(sock)
        req_id = pending.id if pending is not None else wire.loads(frames[0])["id"]
        future: asyncio.Future[Any] = loop.create_future()
        seconds = self.timeout if timeout is None else timeout
        self._track(req_id, pending, on_reply if on_reply is not None else future, seconds)
        try:
            await self._send_frames(sock, frames, time.monotonic() + seconds)
        except zmq.Again:
            if not self._untrack(req_id) and on_reply is not None:
                return future  # expired while the send waited: on_reply has the error
            if future.done():  # expired while the send waited: the error below says it, not asyncio
                future.exception()
            else:
                future.cancel()
            raise self._unreachable(pending) from None
        return future

    def _watch(self, sock: zmq.Socket[Any]) -> asyncio.AbstractEventLoop:
        """The running loop, reading the socket's replies (installed once)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(cast(int, sock.getsockopt(zmq.FD)), self._on_events)
            self._loop = loop
        return loop

    def _track(self, req_id: int, pending: Pending | None, target: Target, seconds: float) -> None:
        assert self._loop is not None
        timer = self._loop.call_later(seconds, self._expire, req_id)
        self._pending[req_id] = (target, pending, timer)
        if pending is not None:
            pending.sent_at = time.perf_counter()

    def _untrack(self, req_id: int) -> bool:
        """Forget a request that was not sent; False when it had expired meanwhile."""
        entry = self._pending.pop(req_id, None)
        if entry is not None:
            entry[2].cancel()
        return entry is not None

    async def _send_frames(self, sock: zmq.Socket[Any], frames: list[Any], deadline: float) -> None:
        """Non-blocking send; while the socket cannot take it (no server yet: IMMEDIATE, or its
        high-water mark), retried every millisecond until `deadline`, then zmq.Again."""
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if time.monotonic() >= deadline or self._sock is not sock:
                    raise
                await asyncio.sleep(_SEND_RETRY_S)
                continue
            self._after_send(sock)
            return

    def _after_send(self, sock: zmq.Socket[Any]) -> None:
        """A send may have eaten the ZMQ_FD edge of a reply that came meanwhile: look now."""
        if cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            cast(asyncio.AbstractEventLoop, self._loop).call_soon(self._on_events)

    def _on_events(self) -> None:
        """Every reply waiting on the socket, dispatched (the reader callback of ZMQ_FD)."""
        sock = self._sock
        while sock is not None:
            try:
                if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    return
                msg = sock.recv_multipart(flags=_NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed meanwhile
                return
            self._dispatch(msg)
            sock = self._sock

    def _dispatch(self, msg: list[Any]) -> None:
        answered = self._answered(msg)
        if answered is None:
            return
        header, (target, pending, timer) = answered
        timer.cancel()
        if isinstance(target, asyncio.Future):
            result, error = self._outcome(header, msg[1:], pending)
        else:  # ring outputs as views: read by the callback before their slots go back
            result, error = self._outcome(header, msg[1:], pending, copy=False)
            if pending is not None:
                pending.release_inputs()
        self._complete(target, pending, result, error)

    def _complete(
        self, target: Target, pending: Pending | None, result: Any, error: ClientError | None
    ) -> None:
        """Hand a request's outcome to its future or callback, then give its slots back."""
        try:
            if not isinstance(target, asyncio.Future):
                target(result, error)
            elif not target.done():
                if error is None:
                    target.set_result(result)
                else:
                    target.set_exception(error)
        except Exception:  # a failing callback must not stop the replies behind it (edge-triggered FD)
            log.exception("reply callback failed")
        finally:
            if pending is not None:
                pending.release_slots()

    def _expire(self, req_id: int) -> None:
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        target, pending, _ = entry
        error = self._timed_out(req_id, pending)
        if isinstance(target, asyncio.Future):
            if not target.done():
                target.set_exception(error)
            return
        try:
            target(None, error)
        except Exception:
            log.exception("reply callback failed")
