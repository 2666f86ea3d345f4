"""One stream's state in the watch pipeline: its mailbox and decoder, its rings, what is in flight."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from edgeserve.client.errors import ClientError
from edgeserve.client.ring import FrameRing
from edgeserve.video.flow import Mailbox, Ready
from edgeserve.video.metrics import StreamStats
from edgeserve.video.sources import SourceSpec, SourceThread

log = logging.getLogger("edgeserve.video")


class Stream:
    def __init__(self, spec: SourceSpec, policy: str) -> None:
        self.spec, self.policy = spec, policy
        self.stats = StreamStats()
        self.mailbox: Mailbox
        self.thread: SourceThread
        self.wake = asyncio.Event()
        self.rings: list[tuple[FrameRing, FrameRing | None]] = []
        self.inflight = 0
        self.ended = False
        self.error: str | None = None
        self.convert_cpu_s = 0.0
        self.overlay: Any = None
        self.parked = False  # the stream's task waits for `wake`: the loop may send for it (Watch._pump)
        self.deferred: list[Ready] = []  # converted frames the loop could not send without waiting
        self._order: collections.deque[Place] = collections.deque()

    def snapshot(self) -> tuple[str, int, dict[str, int], int, int, bool, StreamStats]:
        c = self.thread.counters
        dropped = {**self.mailbox.dropped, "server": self.stats.rejected, "failed": self.stats.failed}
        return (self.spec.name, c.decoded, dropped, c.corrupt, c.reconnects, c.up, self.stats)

    def out_ring(self, ring: FrameRing) -> FrameRing | None:
        return next((out for each, out in self.rings if each is ring), None)

    def failed(self, exc: BaseException) -> None:
        """A request of this stream failed: refused by a busy or gone server, or failed there."""
        if isinstance(exc, ClientError) and exc.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            self.stats.rejected += 1
        else:
            self.stats.failed += 1
        if self.stats.failed + self.stats.rejected <= 3 or log.isEnabledFor(logging.DEBUG):
            log.warning("stream %s: request failed: %s", self.spec.name, exc)

    def release_held(self) -> None:
        """Slots handed to the decoder and not sent: back to their rings."""
        for slot in self.mailbox.reclaim():
            slot.release()
        for ready in self.deferred + self.mailbox.take_ready():
            ready.slot.release()
        self.deferred = []

    def sent(self, place: Place | None = None) -> Place:
        """A place (a new one, or `place`) in the stream's result order for the frame being sent."""
        place = Place() if place is None else place
        self._order.append(place)
        return place

    def answered(self, place: Place, answer: Any) -> list[Any]:
        """The answers now due, in the order their frames were sent (None: the frame got no answer).
        A model with several instances can answer a later frame first; it waits for the earlier
        one, so that subscribers and the overlay see the stream's frames in order."""
        place.done, place.answer = True, answer
        due = []
        while self._order and self._order[0].done:
            first = self._order.popleft().answer
            if first is not None:
                due.append(first)
        return due


class Place:
    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = False
        self.answer: Any = None
