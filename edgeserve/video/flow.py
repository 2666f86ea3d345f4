"""Flow control per stream: which decoded frames go to the model when it is slower than the camera.

    latest  keep only the newest decoded frame; an older one not yet sent is dropped (counted as
            `stale`). The default for live sources: results describe the present, latency stays bounded.
    every   the decoder waits until its frame can go (backpressure: nothing dropped). The default
            for files: every frame gets a result, at the model's pace.
    --fps N at most N frames per second of stream time (by pts) are offered; the others are dropped
            at decode time (counted as `fps`), before any conversion. Combines with either policy.

A frame is converted to the model's input only when it will be sent, so a dropped frame costs its
decode and nothing else. Where the conversion runs: the dispatcher (the event loop) hands the
stream's free ring slots to its mailbox (`give`), and the decoder thread converts the next frame
straight into one, right after decoding it, while its pixels are still in this core's cache (a
third cheaper than converting the same frame later on another thread) and off the event loop; the
dispatcher then only sends it (`take_ready`). A frame that had to wait because every slot was in
flight stays unconverted (`take`); when a slot frees while another frame of the stream is still at
the server, the dispatcher hands it to the decoder if the stream's next frame is due within
`HOT_WAIT` (that frame is newer anyway, and the model is busy meanwhile); otherwise it converts the
waiting frame itself and sends it at once. `notify` tells the dispatcher (on its event loop) that
something is waiting.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgeserve.video.convert import InputSpec, write_input
from edgeserve.video.sources import Decoded

POLICIES = ("latest", "every")
HOT_WAIT = 0.05  # s: a freed slot waits for the next frame when it is due within this


@dataclass(slots=True)
class Ready:
    """A frame converted into its ring slot, to be sent: `tensor` names the slot's contents (None
    when the conversion failed: `error` says why), `size` is the (width, height) the model gets and
    `cpu_s` the conversion's CPU time."""

    item: Decoded
    slot: Any
    tensor: Any
    size: tuple[int, int]
    cpu_s: float
    error: str | None = None


# (frame, free slot) -> the frame converted into the slot, or None when it does not fit the slot
Converter = Callable[[Decoded, Any], "Ready | None"]


def converter(spec: InputSpec, wanted: tuple[int, int] | None) -> Converter:
    """Frame -> the model's input in a free slot (run by the decoder thread, or by the dispatcher
    for a frame that waited); None when the frame does not fit the slot's ring."""

    def convert(item: Decoded, slot: Any) -> Ready | None:
        width, height = spec.size_for(item.width, item.height, wanted)
        if spec.byte_size(width, height) > slot.ring.slot_size:
            return None
        cpu = time.thread_time()
        try:
            tensor, error = write_input(item.frame, slot, spec, width, height), None
        except Exception as exc:  # a frame swscale refuses fails alone
            tensor, error = None, f"{type(exc).__name__}: {exc}"
        return Ready(item, slot, tensor, (width, height), time.thread_time() - cpu, error)

    return convert


class Mailbox:
    """One stream's hand-off between its decoder thread and the dispatcher."""

    def __init__(
        self,
        policy: str,
        fps: float | None,
        notify: Callable[[], None],
        convert: Converter | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if fps is not None and fps <= 0:
            raise ValueError(f"fps must be > 0, not {fps}")
        self.policy, self.fps, self._notify, self._convert = policy, fps, notify, convert
        self._item: Decoded | None = None  # a frame waiting unconverted
        self._slots: collections.deque[Any] = collections.deque()  # given, free for the next frame
        self._ready: collections.deque[Ready] = collections.deque()
        self._feeding = False  # slots keep coming (the ring fits the frames): `every` waits for one
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._quiet = False  # every slot is in flight: a frame that waits needs no wake-up (`hush`)
        self._next_due: float | None = None
        self._last_t0: float | None = None
        self.interval = math.inf  # s between offered frames (moving average)
        self.dropped: dict[str, int] = {"stale": 0, "fps": 0}

    # -- the decoder thread -------------------------------------------------------------------------
    def offer(self, item: Decoded) -> None:
        """A decoded frame. Blocks under the every-frame policy until it can go."""
        if self.fps is not None and not self._due(item):
            self.dropped["fps"] += 1
            return
        if self._last_t0 is not None:
            gap = item.t0 - self._last_t0
            self.interval = gap if math.isinf(self.interval) else 0.8 * self.interval + 0.2 * gap
        self._last_t0 = item.t0
        with self._cond:
            slot = self._wait_for_turn()
            wake = self._keep(item) if slot is None else False
        if slot is None:
            if wake:
                self._notify()
            return
        ready = self._convert(item, slot) if self._convert is not None else None
        with self._cond:
            if ready is None:  # the frame outgrew the ring (a source came back larger)
                self._slots.appendleft(slot)
                self._feeding = False
                wake = self._keep(item)
            else:
                self._ready.append(ready)
                wake = len(self._ready) == 1
        if wake:
            self._notify()

    def _wait_for_turn(self) -> Any:
        """(Lock held.) A free slot to convert into, or None: keep the frame unconverted."""
        while not self._closed:
            if self.policy == "every" and self._item is not None:
                self._cond.wait(0.5)  # the frame before this one goes first
            elif self._slots:
                if self._item is not None:  # a freed slot was left for this newer frame
                    self._item = None
                    self.dropped["stale"] += 1
                return self._slots.popleft()
            elif self.policy == "every" and self._feeding:
                self._cond.wait(0.5)  # every slot is in flight: backpressure
            else:
                return None
        return None

    def _keep(self, item: Decoded) -> bool:
        """(Lock held.) The frame waits unconverted (the newest only, under `latest`); True when the
        dispatcher has to be told."""
        if self._closed:
            return False
        replaced = self._item is not None
        if replaced:
            self.dropped["stale"] += 1
        self._item = item
        return not replaced and not self._ready and not self._quiet

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

    # -- the dispatcher -----------------------------------------------------------------------------
    def feed(self) -> None:
        """The stream's ring fits its frames: from now on, frames wait for a slot under `every`."""
        with self._cond:
            self._feeding = True
            self._cond.notify_all()

    def give(self, slot: Any) -> None:
        """A free slot for the next frame to be converted into."""
        with self._cond:
            self._slots.append(slot)
            self._cond.notify_all()

    def hush(self, quiet: bool = True) -> None:
        """Every slot of the stream is in flight: the dispatcher looks at the waiting frame when
        one comes back, so the decoder need not wake it for each frame it keeps meanwhile (a wasted
        turn of the event loop per frame); `hush(False)` before looking."""
        with self._cond:
            self._quiet = quiet

    def take_ready(self) -> list[Ready]:
        """The frames converted since the last call, oldest first."""
        with self._cond:
            ready = list(self._ready)
            self._ready.clear()
            return ready

    def take(self) -> Decoded | None:
        """The frame waiting unconverted, or None."""
        with self._cond:
            item, self._item = self._item, None
            if item is not None and self.policy == "every":
                self._cond.notify_all()
            return item

    def reclaim(self) -> list[Any]:
        """The given slots not used yet (a frame that waited goes first, a new ring replaces
        theirs, or the stream stops); until `feed` again, frames do not wait for slots."""
        with self._cond:
            slots = list(self._slots)
            self._slots.clear()
            self._feeding = False
            self._cond.notify_all()  # a decoder waiting for a slot keeps its frame instead
            return slots

    def due_in(self) -> float:
        """Seconds until the stream's next frame is expected (inf when no rate is known yet)."""
        if self._last_t0 is None or math.isinf(self.interval):
            return math.inf
        return self._last_t0 + self.interval - time.perf_counter()

    def close(self) -> None:
        """No more frames will be taken: release a decoder blocked in `offer`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def feeding(self) -> bool:
        return self._feeding

    @property
    def unconverted(self) -> bool:
        """A frame waits unconverted."""
        return self._item is not None

    @property
    def held(self) -> int:
        """Slots in here: given and not converted into yet, or converted and not taken yet."""
        return len(self._slots) + len(self._ready)

    @property
    def waiting(self) -> bool:
        """A frame (converted or not) waits to be taken."""
        return self._item is not None or bool(self._ready)
