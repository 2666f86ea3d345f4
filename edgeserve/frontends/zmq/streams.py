# (pyproject's follow_imports=skip for zmq.* hides pyzmq's own types; see README.md here)
"""Streamed requests (`"stream": true`): a decoupled model's 0..N responses as one reply each, in
order, the last with `"final": true` (docs/zmq.md).

Responses come from the data plane's bounded ResponseStream. Every reply of a stream is sent by the
router thread (the stream's `notify` only schedules it there), so their order is the model's. A reply
the client's queue cannot take (SNDHWM: zmq.Again) is kept, and nothing more is taken from the
stream until it goes out (retried with a growing delay): a client that stops reading fills its
queue, then the stream's buffer, then the model waits in `send` and after the stream's stall
timeout the request ends as cancelled. So the server holds at most SNDHWM replies in ZeroMQ's queue
plus the stream's bound (and one batch taken from it) per streamed request, whatever the model sends.
A client that is gone (EHOSTUNREACH) or cancels (`op: cancel`) ends the request: its model sees
`cancelled`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from edgeserve.frontends.zmq import replies
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from edgeserve.frontends.zmq.codec import Decoded
    from edgeserve.frontends.zmq.router import Router
    from edgeserve.server.streaming import ResponseStream

log = logging.getLogger("edgeserve.zmq")

RETRY_FIRST_S = 0.002  # a full client queue: first retry; doubles up to RETRY_MAX_S
RETRY_MAX_S = 0.05
CANCELLED_MESSAGE = "streamed request cancelled by the client"


class Live:
    """One streamed request between its submit and its final reply (router thread only)."""

    __slots__ = ("backlog", "decoded", "done", "envelope", "key", "model", "owner", "retry_s", "retrying",
                 "stream", "version")  # fmt: skip

    def __init__(self, owner: Any, envelope: list[bytes], decoded: Decoded, key: Any) -> None:
        self.owner = owner  # the frontend's peer
        self.envelope = envelope
        self.decoded = decoded
        self.key = key  # the request id, when a cancel can name it
        self.stream: ResponseStream | None = None
        self.backlog: deque[tuple[list[Any], bool]] = deque()  # taken, not yet sent: (frames, final)
        self.model = decoded.request.model_name
        self.version = decoded.request.model_version
        self.retry_s = 0.0
        self.retrying = False
        self.done = False


class StreamPump:
    """Moves streamed responses from their ResponseStreams to the ROUTER socket."""

    def __init__(
        self,
        router: Callable[[], Router | None],
        finished: Callable[[Live], None],
        unreachable: Callable[[Live], None],
    ) -> None:
        self._router = router
        self._finished = finished  # the request is over: counters, the decoded request's leases
        self._unreachable = unreachable  # its client is gone
        self.stalled = 0  # streams given up because their client stopped reading

    def notifier(self, live: Live) -> Callable[[ResponseStream], None]:
        """The stream's `notify` (any thread): pump it on the router thread."""

        def notify(stream: ResponseStream) -> None:
            router = self._router()
            if router is not None:
                router.call_soon(lambda: self.pump(live))

        return notify

    def pump(self, live: Live) -> None:
        """Send what the stream holds, in order, as far as the client's queue takes it."""
        router, stream = self._router(), live.stream
        if router is None or stream is None or live.done:
            return
        while True:
            if not live.backlog:
                for result, final in stream.take():
                    if result is not None and not isinstance(result, InferenceError):
                        live.model, live.version = result.model_name, result.model_version
                    frames = replies.stream_reply(live.decoded, result, final, live.model, live.version)
                    live.backlog.append((frames, final))
                if not live.backlog:
                    return
            frames, final = live.backlog[0]
            error = router.send(live.envelope + frames)
            if error is None:
                live.backlog.popleft()
                live.retry_s = 0.0
                if final:
                    self._end(live)
                    return
                continue
            if isinstance(error, zmq.Again):
                if stream.cancelled:  # stalled: the client stopped reading; it never sees the rest
                    self.stalled += 1
                    log.warning("zmq streamed request %r: its client stopped reading; dropped",
                                live.decoded.req_id)  # fmt: skip
                    self._end(live)
                    return
                self._retry(router, live)
                return
            stream.cancel()
            self._end(live)
            if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
                self._unreachable(live)
            else:
                log.warning("zmq streamed reply to request %r failed: %s", live.decoded.req_id, error)
            return

    def cancel(self, live: Live, why: str = CANCELLED_MESSAGE, reply: bool = True) -> None:
        """End the request now: the model sees cancelled; the client gets one final CANCELLED reply."""
        if live.done:
            return
        if live.stream is not None:
            live.stream.cancel()
        router = self._router()
        self._end(live)
        if reply and router is not None:
            router.send(live.envelope + replies.error_reply(
                live.decoded.req_id, InferenceError(Status.CANCELLED, why), final=True
            ))  # fmt: skip

    def _retry(self, router: Router, live: Live) -> None:
        if live.retrying:
            return
        live.retrying = True
        live.retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, 2 * live.retry_s))

        def again() -> None:
            live.retrying = False
            self.pump(live)

        router.call_later(live.retry_s, again)

    def _end(self, live: Live) -> None:
        live.done = True
        live.backlog.clear()
        self._finished(live)
