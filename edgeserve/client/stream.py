"""Streamed requests (`infer_stream`): a decoupled model's 0..N responses, one reply each, the last
marked `"final": true` (docs/zmq.md, "Streamed requests"). The client routes a streamed request's
replies here by id (ClientBase._answered); the sync iterator receives them while it waits, the
asyncio one is woken by the socket's reader callback.

`timeout` is the longest wait for the next response: past it the request is cancelled (the server
ends it and its model sees `request.is_cancelled()`) and DEADLINE_EXCEEDED raised. Leaving a `with`
block or calling `cancel()` before the final reply cancels it the same way. An error response raises
ClientError; when it was not the final one, iterating again gives the responses after it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from edgeserve.client import _core
from edgeserve.client._core import InferResult, Pending
from edgeserve.client.errors import ClientError
from edgeserve.frontends.zmq import wire


class StreamState:
    """What the client knows of one streamed request: replies not yet read, and whether it ended."""

    __slots__ = ("deadline", "final", "items", "on_item", "pending", "stopped", "timeout")

    def __init__(self, pending: Pending, timeout: float) -> None:
        self.pending = pending
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.items: deque[tuple[dict[str, Any], Sequence[Any]]] = deque()
        self.final = False  # the server's final reply came: the request is over there
        self.stopped = False  # the caller cancelled: nothing more is read
        self.on_item: Callable[[], None] | None = None  # the asyncio iterator's wake-up

    def deliver(self, header: dict[str, Any], frames: Sequence[Any]) -> bool:
        """One reply (the client's receive path); True when it was the final one."""
        final = header.get("final") is not False  # a reply without the field (an old server): final
        if final:
            self.final = True
            self.pending.release_slots()  # the server is done with the request's ring slots
        if not self.stopped:
            self.items.append((header, frames))
            self.deadline = time.monotonic() + self.timeout
            if self.on_item is not None:
                self.on_item()
        return final

    def fail(self, error: ClientError) -> None:
        """The client closed: the request ends with `error`."""
        if not self.final:
            self.deliver({"id": self.pending.id, "status": error.status, "message": error.message}, ())

    def next_result(self) -> InferResult | None:
        """The next response's result (None: nothing to read now, or the final flag alone);
        raises ClientError for an error response."""
        while self.items:
            header, frames = self.items.popleft()
            if header.get("status") == wire.STATUS_OK and not header.get("outputs") and header.get("final"):
                continue  # the final flag alone: no response
            return _core.parse_infer(header, frames, self.pending)
        return None

    @property
    def exhausted(self) -> bool:
        return not self.items and (self.final or self.stopped)

    def take(self, cancel: Callable[[], None]) -> InferResult | None:
        """The next response's result, or None: wait for a reply until `deadline`. Raises StreamEnded
        when no more can come, ClientError for an error response, and DEADLINE_EXCEEDED (after
        `cancel()`) when the wait passed `timeout`."""
        result = self.next_result()
        if result is not None:
            return result
        if self.exhausted:
            raise StreamEnded
        if time.monotonic() >= self.deadline:
            cancel()
            waited = f"no response to streamed request {self.pending.id} in {self.timeout:g} s"
            raise ClientError("DEADLINE_EXCEEDED", waited)
        return None


class StreamEnded(Exception):
    """No more responses: the final one was read, or the caller cancelled."""


def cancel_frames(req_id: int) -> list[Any]:
    return _core.build_control(req_id, wire.OP_CANCEL)


class ZmqStream:
    """The iterator `ZmqClient.infer_stream` returns: yields each response's InferResult."""

    def __init__(
        self, state: StreamState, pump: Callable[[float], None], send: Callable[[list[Any]], None]
    ) -> None:
        self._state = state
        self._pump = pump  # receives replies until the given monotonic time
        self._send = send  # sends a message without waiting (the cancel)

    @property
    def id(self) -> int:
        return self._state.pending.id

    def __iter__(self) -> ZmqStream:
        return self

    def __next__(self) -> InferResult:
        while True:
            try:
                result = self._state.take(self.cancel)
            except StreamEnded:
                raise StopIteration from None
            if result is not None:
                return result
            self._pump(self._state.deadline)

    def cancel(self) -> None:
        """Stop the request (the server ends it; its model sees cancelled); nothing more is yielded."""
        state = self._state
        if state.final or state.stopped:
            return
        state.stopped = True
        state.items.clear()
        self._send(cancel_frames(self.id))

    def __enter__(self) -> ZmqStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class AsyncZmqStream:
    """The async iterator `AsyncZmqClient.infer_stream` returns; the request is sent on the first
    `__anext__` (or `async with`)."""

    def __init__(
        self, state: StreamState, start: Callable[[], Any], send: Callable[[list[Any]], None]
    ) -> None:
        self._state = state
        self._start = start  # a coroutine function that sends the request
        self._send = send
        self._started = False
        self._waiter: asyncio.Future[None] | None = None
        state.on_item = self._wake

    @property
    def id(self) -> int:
        return self._state.pending.id

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def start(self) -> None:
        """Send the request (once; not after an early `cancel()`)."""
        if not self._started:
            self._started = True
            if not self._state.stopped:
                await self._start()

    def __aiter__(self) -> AsyncZmqStream:
        return self

    async def __anext__(self) -> InferResult:
        await self.start()
        while True:
            try:
                result = self._state.take(self.cancel)
            except StreamEnded:
                raise StopAsyncIteration from None
            if result is not None:
                return result
            left = max(0.0, self._state.deadline - time.monotonic())
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._waiter), left)
            except asyncio.TimeoutError:
                pass  # the loop checks the deadline again (a reply may have moved it)
            finally:
                self._waiter = None

    def cancel(self) -> None:
        state = self._state
        if state.final or state.stopped or not self._started:
            state.stopped = True
            return
        state.stopped = True
        state.items.clear()
        self._send(cancel_frames(self.id))

    async def __aenter__(self) -> AsyncZmqStream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
