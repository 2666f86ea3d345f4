"""When the ZeroMQ thread spins before sleeping, and for how long (router.py's idle wait); and, for
it and the client, whether the core is free enough for spinning to pay at all (`CoreShare`).

Spinning pays while requests arrive close together: a client sending back to back then finds the
thread awake, and the box's vCPUs never halt between requests. It costs a core otherwise, so the
thread spins only while the moving average of its idle gaps (each capped at a few windows, so a
long idle spell is forgotten after a few close requests) stays within the window.

It also costs when other processes want the core: the spinner yields at every poll, and a yielding
thread waits behind them for its turn, where a sleeping thread that is woken runs at once (measured
on a loaded 2-vCPU box: p50 round trip above in-process 0.38 ms with no spinning, 0.49 ms with).
`CoreShare` watches how much of the core a spinning thread actually gets (its CPU time over the
spin's wall time); while that share stays low the thread sleeps instead, trying again later.

The clocks and the pause between polls are injected: the decisions are tested with fake clocks
(tests/frontends/zmq/test_zmq_spin.py); how many requests a real box catches is a measurement
(benchmarks/bench_zmq_spin.py), not a test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

GAP_WEIGHT = 0.125  # of the newest gap between requests in the average that turns spinning on
GAP_CAP_WINDOWS = 8  # a gap counts as at most this many spin windows
SHARE_MIN = 0.5  # the share of its core a spinning thread must get for spinning to go on
SHARE_WEIGHT = 0.25  # of the newest spin's share in the average
SHARE_RETRY = 0.75  # the average a spin starts from again after a back-off (fewer poor spins end it)
SHARE_SAMPLE_MIN_S = 50e-6  # shorter spins say little about the core
BACKOFF_WAITS = 64  # waits that sleep at once after spinning stopped paying, before it is tried again


class CoreShare:
    """Whether a spinning thread gets its core: the moving average of its CPU time over wall time
    while it spins. Below SHARE_MIN the next BACKOFF_WAITS waits sleep at once, then spinning is
    tried again (load comes and goes)."""

    def __init__(self, cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.cpu_clock = cpu_clock
        self.share = 1.0
        self.backoff = 0

    def ready(self) -> bool:
        """Spin on this wait? False (and one wait less to sit out) while backing off."""
        if self.backoff:
            self.backoff -= 1
            return False
        return True

    def record(self, wall_s: float, cpu_start: float) -> None:
        """A spin of `wall_s` seconds that began when the CPU clock read `cpu_start`."""
        if wall_s < SHARE_SAMPLE_MIN_S:
            return
        share = min(1.0, (self.cpu_clock() - cpu_start) / wall_s)
        self.share += (share - self.share) * SHARE_WEIGHT
        if self.share < SHARE_MIN:
            self.backoff = BACKOFF_WAITS
            self.share = SHARE_RETRY


class SpinPolicy:
    def __init__(
        self,
        spin_us: int,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[], None] = os.sched_yield,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.spin_s = max(0, spin_us) / 1e6
        self.clock = clock
        self._pause = pause
        self.core = CoreShare(cpu_clock)
        self.gap_s = 0.0  # average wait for the next request once idle

    def active(self) -> bool:
        """Spin before the next sleep: a window is set, requests have been coming within it, and the
        core has been ours while spinning (counts one wait of a back-off)."""
        return self.spin_s > 0 and self.gap_s <= self.spin_s and self.core.ready()

    def record_gap(self, gap_s: float) -> None:
        """An idle wait that ended in a request after `gap_s` seconds."""
        gap = min(gap_s, GAP_CAP_WINDOWS * self.spin_s)
        self.gap_s += (gap - self.gap_s) * GAP_WEIGHT

    def wait(self, since: float, ready: Callable[[], bool], woken: Callable[[], bool]) -> bool:
        """Poll `ready` until it is true (True) or the window from `since` is over (False), pausing
        (yielding the core) between polls; False at once when `woken` (other work for the thread)."""
        until = since + self.spin_s
        cpu_start = self.core.cpu_clock()
        caught = False
        while not woken():
            if ready():
                caught = True
                break
            if self.clock() >= until:
                break
            self._pause()
        self.core.record(self.clock() - since, cpu_start)
        return caught
