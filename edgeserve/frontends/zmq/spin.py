"""When the ZeroMQ thread spins before sleeping, and for how long (router.py's idle wait).

Spinning pays while requests arrive close together: a client sending back to back then finds the
thread awake, and the box's vCPUs never halt between requests. It costs a core otherwise, so the
thread spins only while the moving average of its idle gaps (each capped at a few windows, so a
long idle spell is forgotten after a few close requests) stays within the window.

The clock and the pause between polls are injected: the decisions are tested with a fake clock
(tests/frontends/zmq/test_zmq_spin.py); how many requests a real box catches is a measurement
(benchmarks/bench_zmq_spin.py), not a test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

GAP_WEIGHT = 0.125  # of the newest gap between requests in the average that turns spinning on
GAP_CAP_WINDOWS = 8  # a gap counts as at most this many spin windows


class SpinPolicy:
    def __init__(
        self,
        spin_us: int,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[], None] = os.sched_yield,
    ) -> None:
        self.spin_s = max(0, spin_us) / 1e6
        self.clock = clock
        self._pause = pause
        self.gap_s = 0.0  # average wait for the next request once idle

    def active(self) -> bool:
        """Spin before the next sleep: a window is set and requests have been coming within it."""
        return self.spin_s > 0 and self.gap_s <= self.spin_s

    def record_gap(self, gap_s: float) -> None:
        """An idle wait that ended in a request after `gap_s` seconds."""
        gap = min(gap_s, GAP_CAP_WINDOWS * self.spin_s)
        self.gap_s += (gap - self.gap_s) * GAP_WEIGHT

    def wait(self, since: float, ready: Callable[[], bool], woken: Callable[[], bool]) -> bool:
        """Poll `ready` until it is true (True) or the window from `since` is over (False), pausing
        (yielding the core) between polls; False at once when `woken` (other work for the thread)."""
        until = since + self.spin_s
        while not woken():
            if ready():
                return True
            if self.clock() >= until:
                return False
            self._pause()
        return False
