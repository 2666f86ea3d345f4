"""Flow control per stream: which decoded frames go to the model when it is slower than the camera.

    latest  keep only the newest decoded frame; an older one not yet sent is dropped (counted as
            `stale`). The default for live sources: results describe the present, latency stays bounded.
    every   the decoder waits until its frame is taken (backpressure: nothing dropped). The default
            for files: every frame gets a result, at the model's pace.
    --fps N at most N frames per second of stream time (by pts) are offered; the others are dropped
            at decode time (counted as `fps`), before any conversion. Combines with either policy.

A frame is converted to the model's input only when it is taken, so a dropped frame costs its
decode and nothing else. The decoder thread offers, the dispatcher takes; `notify` tells the
dispatcher (on its event loop) that a frame is waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from edgeserve.video.sources import Decoded

POLICIES = ("latest", "every")


class Mailbox:
    """One stream's hand-off between its decoder thread and the dispatcher (at most one frame)."""

    def __init__(self, policy: str, fps: float | None, notify: Callable[[], None]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if fps is not None and fps <= 0:
            raise ValueError(f"fps must be > 0, not {fps}")
        self.policy, self.fps, self._notify = policy, fps, notify
        self._item: Decoded | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._next_due: float | None = None
        self.dropped: dict[str, int] = {"stale": 0, "fps": 0}

    def offer(self, item: Decoded) -> None:
        """From the decoder thread. Blocks under the every-frame policy until the frame is taken."""
        if self.fps is not None and not self._due(item):
            self.dropped["fps"] += 1
            return
        with self._cond:
            if self.policy == "every":
                while self._item is not None and not self._closed:
                    self._cond.wait(0.5)
            if self._closed:
                return
            was_empty = self._item is None
            if not was_empty:
                self.dropped["stale"] += 1
            self._item = item
        if was_empty:
            self._notify()

    def _due(self, item: Decoded) -> bool:
        assert self.fps is not None
        when = item.pts if item.pts is not None else item.t0
        period = 1.0 / self.fps
        due = self._next_due
        if due is None or when > due + period or when < due - 2 * period:
            due = when  # the first frame, a gap, a reconnect (pts start over): count from this frame
        if when + 1e-6 < due:
            self._next_due = due
            return False
        self._next_due = due + period
        return True

    def take(self) -> Decoded | None:
        """From the dispatcher: the waiting frame, or None."""
        with self._cond:
            item, self._item = self._item, None
            if item is not None and self.policy == "every":
                self._cond.notify_all()
            return item

    def close(self) -> None:
        """No more frames will be taken: release a decoder blocked in `offer`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def waiting(self) -> bool:
        return self._item is not None
