"""One decoupled request's responses on their way from the model to a frontend, with backpressure.

The model's threads `put` responses (through the scheduler's ResponseSink); the frontend `take`s them
when told (`notify(stream)`, called once each time the buffer goes from drained to holding something). The
buffer holds at most `capacity` responses: a model sending faster than its reader reads waits in
`put`, and when the reader takes nothing for `stall_s` the request ends as cancelled (the model sees
`cancelled`, its later responses are dropped), so a stuck reader never grows the server's memory.

Bounds per model, from its config.pbtxt `parameters` (STREAM_BUFFER_PARAMETER, STREAM_STALL_PARAMETER).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

    from edgeserve.protocol.inference import InferResponse

STREAM_BUFFER_PARAMETER = "stream_buffer_responses"
STREAM_STALL_PARAMETER = "stream_stall_timeout_s"
DEFAULT_CAPACITY = 64
DEFAULT_STALL_S = 30.0
STALLED_MESSAGE = "response stream cancelled: its reader took no response for {seconds:g} s"

# (response, error, or None for a final flag without a response; final)
StreamItem: TypeAlias = "tuple[InferResponse | InferenceError | None, bool]"


def stream_bounds(config: ModelConfig | None) -> tuple[int, float]:
    """(capacity, stall seconds) from the model's parameters, defaults where absent or unreadable."""
    capacity, stall_s = DEFAULT_CAPACITY, DEFAULT_STALL_S
    if config is None:
        return capacity, stall_s
    params = config.parameters
    try:
        if STREAM_BUFFER_PARAMETER in params:
            capacity = max(1, int(params[STREAM_BUFFER_PARAMETER].string_value))
        if STREAM_STALL_PARAMETER in params:
            stall_s = max(0.001, float(params[STREAM_STALL_PARAMETER].string_value))
    except ValueError:
        pass  # validated at load by the repository's parameter checks; keep the defaults here
    return capacity, stall_s


class ResponseStream:
    """Thread-safe bounded buffer of one request's responses, in order, ending with one final item."""

    __slots__ = ("_cancel", "_cond", "_ended", "_items", "_notify", "_signalled", "cancelled",
                 "capacity", "peak", "stall_s", "taken")  # fmt: skip

    def __init__(
        self,
        notify: Callable[[ResponseStream], None],
        capacity: int = DEFAULT_CAPACITY,
        stall_s: float = DEFAULT_STALL_S,
    ) -> None:
        self._notify = notify
        self.capacity = capacity
        self.stall_s = stall_s
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[StreamItem] = deque()
        self._signalled = False  # notify was called and the reader has not taken since
        self._ended = False  # the final item is in (or the stream was cancelled)
        self._cancel: Callable[[], None] | None = None
        self.cancelled = False
        self.peak = 0  # most responses buffered at once (tests check the bound with it)
        self.taken = 0  # responses the reader took

    def on_cancel(self, cancel: Callable[[], None]) -> None:
        """What ends the request upstream (the scheduler's job) when the stream is cancelled."""
        with self._cond:
            run_now = self.cancelled
            self._cancel = None if run_now else cancel
        if run_now:
            cancel()

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, result: InferResponse | InferenceError | None, final: bool) -> bool:
        """Add one response (the model's thread). Waits while the buffer is full, at most `stall_s`
        in all; then the stream is cancelled. False when the response was dropped (cancelled, or
        after the final one)."""
        with self._cond:
            if self._ended or self.cancelled:
                return False
            if len(self._items) >= self.capacity and not final:
                deadline = time.monotonic() + self.stall_s
                while len(self._items) >= self.capacity and not self.cancelled:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self.cancelled:
                    return False
                if len(self._items) >= self.capacity:
                    return self._stalled()
            # a final item may go one past the bound: the request must end even with a stuck reader
            self._items.append((result, final))
            self._ended = final
            self.peak = max(self.peak, len(self._items))
            signal = not self._signalled
            self._signalled = True
        if signal:
            self._notify(self)
        return True

    def _stalled(self) -> bool:  # lock held
        error = InferenceError(Status.CANCELLED, STALLED_MESSAGE.format(seconds=self.stall_s))
        self._items.append((error, True))
        self._ended = True
        self.cancelled = True
        cancel, self._cancel = self._cancel, None
        signal = not self._signalled
        self._signalled = True
        self._cond.release()
        try:
            if cancel is not None:
                cancel()
            if signal:
                self._notify(self)
        finally:
            self._cond.acquire()
        return False

    def take(self) -> list[StreamItem]:
        """Everything buffered now, in order (the reader's thread); frees room for the model."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._signalled = False
            self.taken += len(items)
            self._cond.notify_all()
        return items

    def cancel(self) -> None:
        """The reader went away or cancelled: drop what is buffered and what comes, end the request."""
        with self._cond:
            if self.cancelled:
                return
            self.cancelled = True
            self._ended = True
            self._items.clear()
            cancel, self._cancel = self._cancel, None
            self._cond.notify_all()
        if cancel is not None:
            cancel()
