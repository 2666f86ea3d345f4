"""asyncio ZeroMQ client: `await client.infer(...)`, or `await client.submit(...)` for pipelining.

The socket is a plain (non-asyncio) DEALER watched with `loop.add_reader` on its ZMQ_FD: sends are
non-blocking calls and replies are drained by one callback, with none of zmq.asyncio's per-message
futures (a quarter of the client's CPU on a small model's round trip). ZMQ_FD is edge-triggered:
after every send the socket's EVENTS are checked for replies that arrived meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

import zmq

from edgeserve.client import _core
from edgeserve.client._core import InferResult, InputValue, Outputs, Pending
from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing
from edgeserve.client.zmq_client import _EVENTS, _LATE_MAX, _POLLIN, DEFAULT_ENDPOINT
from edgeserve.frontends.zmq import wire

_SEND_RETRY_S = 0.001


class AsyncZmqClient:
    """The asyncio twin of `ZmqClient`; use it from one event loop."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = 10.0,
        *,
        copy_inputs: bool = True,
        context: zmq.Context[Any] | None = None,
        identity: bytes | None = None,
    ) -> None:
        """`context`: any zmq.Context (a zmq.asyncio one too: the socket made here is a plain one)."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.copy_inputs = copy_inputs
        self.identity = identity or uuid.uuid4().bytes
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = _core.dealer_socket(self._ctx, endpoint, self.identity, timeout)
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader is installed
        self._next_id = _core.first_request_id()
        self._pending: dict[int, tuple[asyncio.Future[Any], Pending | None, asyncio.TimerHandle]] = {}
        self._late: dict[int, Pending] = {}
        self._rings: list[FrameRing] = []
        self._registrations = _core.Registrations()

    # -- inference ------------------------------------------------------------------------------
    async def submit(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Outputs = None,
        *,
        version: str = "",
        ring: FrameRing | None = None,
        timeout: float | None = None,
        priority: int = 0,
        timeout_us: int = 0,
        parameters: Mapping[str, Any] | None = None,
    ) -> asyncio.Future[InferResult]:
        """Send one request; returns a future of its result (same arguments as `ZmqClient.submit`)."""
        if self._registrations.lost:
            await self._register_again()
        pending = Pending(self._take_id())
        frames = _core.build_infer(
            pending,
            model,
            inputs,
            outputs,
            version=version,
            ring=ring,
            priority=priority,
            timeout_us=timeout_us,
            parameters=parameters,
            copy_inputs=self.copy_inputs,
        )
        return await self._send(pending, frames, timeout)

    async def infer(
        self, model: str, inputs: Mapping[str, InputValue], outputs: Outputs = None, **kwargs: Any
    ) -> InferResult:
        future = await self.submit(model, inputs, outputs, **kwargs)
        return await future

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
        try:
            await self.register_ring(ring)
        except ClientError as exc:
            ring.close()
            # A sealed memfd is reachable only from the server's user and PID namespace (a producer
            # in another container is not): fall back to a /dev/shm ring, read with one copy.
            if not ring.sealed or exc.status not in ("NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARG"):
                raise
            ring = FrameRing(slots, slot_size, name=name, sealed=False)
            try:
                await self.register_ring(ring)
            except BaseException:
                ring.close()
                raise
        except BaseException:
            ring.close()
            raise
        self._rings.append(ring)
        return ring

    async def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(ClientError, asyncio.TimeoutError):
            await self._call(wire.OP_BYE, min(self.timeout, 1.0))
        for future, pending, timer in list(self._pending.values()):
            timer.cancel()
            if pending is not None:
                pending.release_slots()
            if not future.done():
                future.set_exception(ClientError("UNAVAILABLE", "the client was closed"))
        self._pending.clear()
        if self._loop is not None:
            with contextlib.suppress(Exception):  # a closed loop has nothing to remove
                self._loop.remove_reader(cast(int, self._sock.getsockopt(zmq.FD)))
            self._loop = None
        self._sock.close(linger=0)
        self._sock = None
        for ring in self._rings:
            ring.close()
        self._rings = []

    async def __aenter__(self) -> AsyncZmqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------------
    def _take_id(self) -> int:
        req_id = self._next_id
        self._next_id += 1
        return req_id

    async def _call(self, op: str, timeout: float | None, **fields: Any) -> dict[str, Any]:
        future = await self._send(None, _core.build_control(self._take_id(), op, **fields), timeout)
        header: dict[str, Any] = await future
        return header

    async def _send(
        self, pending: Pending | None, frames: list[Any], timeout: float | None
    ) -> asyncio.Future[Any]:
        sock = self._sock
        if sock is None:
            if pending is not None:
                pending.release_slots()
            raise ClientError("UNAVAILABLE", "the client is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(cast(int, sock.getsockopt(zmq.FD)), self._on_events)
            self._loop = loop
        req_id = pending.id if pending is not None else wire.loads(frames[0])["id"]
        future: asyncio.Future[Any] = loop.create_future()
        seconds = self.timeout if timeout is None else timeout
        timer = loop.call_later(seconds, self._expire, req_id)
        self._pending[req_id] = (future, pending, timer)
        if pending is not None:
            pending.sent_at = time.perf_counter()
        try:
            await self._send_frames(sock, frames, time.monotonic() + seconds)
        except zmq.Again:
            self._pending.pop(req_id, None)
            timer.cancel()
            if future.done():  # expired while the send waited: the error below says it, not asyncio
                future.exception()
            else:
                future.cancel()
            if pending is not None:
                pending.release_slots()
            raise ClientError(
                "UNAVAILABLE",
                f"cannot reach edgeserve at {self.endpoint} (is `edgeserve run` serving this endpoint?)",
            ) from None
        return future

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
            if cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:  # the send may have eaten the FD's edge
                asyncio.get_running_loop().call_soon(self._on_events)
            return

    def _on_events(self) -> None:
        """Every reply waiting on the socket, dispatched (the reader callback of ZMQ_FD)."""
        sock = self._sock
        while sock is not None:
            try:
                if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    return
                msg = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed meanwhile
                return
            self._dispatch(msg)
            sock = self._sock

    def _dispatch(self, msg: list[Any]) -> None:
        try:
            header = wire.loads(msg[0].buffer)
        except ValueError:
            return
        if not isinstance(header, dict) or header.get("op") == wire.OP_PROBE:
            return
        req_id = header.get("id")
        entry = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
        if entry is None:
            late = self._late.pop(req_id, None) if isinstance(req_id, int) else None
            if late is not None:
                for slot in late.slots:
                    slot.ring.release(slot)
            return
        future, pending, timer = entry
        timer.cancel()
        try:
            if pending is None:
                _core.check_status(header)
                result: Any = header
            else:
                result = _core.parse_infer(header, msg[1:], pending)
        except ClientError as exc:
            self._registrations.note(exc)
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(result)
        finally:
            if pending is not None:
                pending.release_slots()

    def _expire(self, req_id: int) -> None:
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        future, pending, _ = entry
        if pending is not None:
            for slot in pending.slots:
                slot.ring.quarantine(slot)
            self._late[req_id] = pending
            if len(self._late) > _LATE_MAX:
                self._late.pop(next(iter(self._late)))
        if not future.done():
            future.set_exception(
                ClientError("DEADLINE_EXCEEDED", f"no reply to request {req_id} from {self.endpoint} in time")
            )
