"""The ZeroMQ thread's spin decisions with an injected clock: a request that arrives within the window
is caught, none past it; a wake-up ends the spin; requests that come close together keep spinning on,
spaced ones turn it off (and close ones back on); spin_us = 0 never spins. And the real router with a
frozen clock: a request that arrives while it spins is counted as a spin hit, never with spin_us = 0.
No assertion depends on how fast this box is (the measurement is benchmarks/bench_zmq_spin.py)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from es_server import wait_until

from edgeserve.frontends.zmq.router import Router
from edgeserve.frontends.zmq.spin import BACKOFF_WAITS, SHARE_RETRY, SHARE_SAMPLE_MIN_S, CoreShare, SpinPolicy

WINDOW_US = 10_000


class FakeClock:
    """Time moves only when the spinner pauses (by `step` seconds); `on_pause` runs at each pause."""

    def __init__(self, step: float = 0.001) -> None:
        self.now = 100.0
        self.step = step
        self.pauses = 0
        self.on_pause: Callable[[int], None] = lambda n: None

    def __call__(self) -> float:
        return self.now

    def pause(self) -> None:
        self.pauses += 1
        self.now += self.step
        self.on_pause(self.pauses)


def policy(spin_us: int = WINDOW_US, step: float = 0.001) -> tuple[SpinPolicy, FakeClock]:
    clock = FakeClock(step)  # also the CPU clock: the spinner has its core all the time
    return SpinPolicy(spin_us, clock, clock.pause, clock), clock


def test_a_request_within_the_window_is_caught() -> None:
    spin, clock = policy()
    arrives_at = clock.now + 0.0035
    assert spin.active()
    assert spin.wait(clock.now, lambda: clock.now >= arrives_at, lambda: False)
    assert clock.pauses == 4


def test_none_past_the_window() -> None:
    spin, clock = policy()
    since = clock.now
    assert not spin.wait(since, lambda: clock.now >= since + 0.011, lambda: False)
    assert clock.now == pytest.approx(since + 0.010)  # gave up when the window closed


def test_a_wake_up_ends_the_spin_at_once() -> None:
    spin, clock = policy()
    assert not spin.wait(clock.now, lambda: False, lambda: True)
    assert clock.pauses == 0


def test_back_to_back_requests_keep_it_spinning_and_every_one_is_caught() -> None:
    spin, clock = policy()
    hits = 0
    for _ in range(50):  # each request comes 0.2 ms after the thread went idle
        since = clock.now
        arrives_at = since + 0.0002

        def arrived(at: float = arrives_at) -> bool:
            return clock.now >= at

        if spin.active() and spin.wait(since, arrived, lambda: False):
            hits += 1
        spin.record_gap(clock.now - since)
    assert hits == 50


def test_spaced_requests_turn_it_off_and_close_ones_back_on() -> None:
    spin, _ = policy()
    states = []
    for _ in range(6):  # 30 ms apart: the average climbs past the 10 ms window
        spin.record_gap(0.030)
        states.append(spin.active())
    assert states == [True, True, True, False, False, False]
    spin.record_gap(3600.0)  # a long idle spell counts as 8 windows at most
    assert spin.gap_s <= 8 * 0.010
    back = 0
    while not spin.active():
        spin.record_gap(0.0001)
        back += 1
    assert back <= 12  # forgotten after a few close requests


def test_a_spinner_that_does_not_get_its_core_sleeps_for_a_while_then_tries_again() -> None:
    """Other processes busy on the core: the spinning thread gets a fifth of it. Spinning stops after
    a few such spins, the next BACKOFF_WAITS waits sleep at once, then it is tried again; while the
    core is free again, it goes on."""
    clock = FakeClock()
    cpu = {"t": 0.0, "share": 0.2}

    def pause() -> None:
        clock.pause()
        cpu["t"] += clock.step * cpu["share"]

    spin = SpinPolicy(WINDOW_US, clock, pause, lambda: cpu["t"])

    def one_wait() -> bool:
        """One idle wait whose request comes 2 ms in; True when it spun."""
        since = clock.now
        if not spin.active():
            return False
        spin.wait(since, lambda: clock.now >= since + 0.002, lambda: False)
        return True

    spins = 0
    while one_wait():
        spins += 1
        assert spins < 10, "kept spinning on a core it did not get"
    assert spins >= 2 and spin.core.backoff == BACKOFF_WAITS - 1  # the wait that slept counts
    assert [one_wait() for _ in range(BACKOFF_WAITS - 1)] == [False] * (BACKOFF_WAITS - 1)
    retried = 0
    while one_wait():  # tried again: the core is still busy, so a few spins end it again
        retried += 1
        assert retried < 10
    assert 1 <= retried < spins
    for _ in range(BACKOFF_WAITS - 1):
        one_wait()
    cpu["share"] = 0.9  # the other processes are gone
    assert all(one_wait() for _ in range(200))


def test_core_share_ignores_spins_too_short_to_tell() -> None:
    cpu = [0.0]
    core = CoreShare(lambda: cpu[0])
    for _ in range(100):
        core.record(SHARE_SAMPLE_MIN_S / 2, 0.0)  # no CPU at all, but each spin was very short
    assert core.ready() and core.share == 1.0
    core.record(0.001, 0.0)
    core.record(0.001, 0.0)
    assert core.share < 1.0 and core.backoff == 0  # two poor spins: not yet
    core.record(0.001, 0.0)
    assert core.backoff == BACKOFF_WAITS and core.share == SHARE_RETRY


def test_zero_never_spins() -> None:
    spin, clock = policy(spin_us=0)
    for _ in range(10):
        spin.record_gap(0.0)
        assert not spin.active()
    assert clock.pauses == 0


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/spin.zmq"


@contextlib.contextmanager
def _wired(endpoint: str, spin: SpinPolicy) -> Iterator[tuple[Router, zmq.Socket[Any], list[Any]]]:
    """A real router with `spin` on `endpoint`, a DEALER connected to it, and what the router got."""
    got: list[Any] = []
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    router = Router(got.append, lambda: None, sndhwm=100, spin=spin)
    router.bind([endpoint])
    router.start()
    try:
        dealer.connect(endpoint)
        yield router, dealer, got
    finally:
        router.close()
        dealer.close()
        ctx.term()


def test_the_router_counts_a_request_that_arrives_while_it_spins(endpoint: str) -> None:
    clock = FakeClock(step=0.0)  # frozen: the spin lasts until the request is there
    spin = SpinPolicy(WINDOW_US, clock, clock.pause, clock)
    sent = threading.Event()
    with _wired(endpoint, spin) as (router, dealer, got):

        def send_once(pauses: int) -> None:
            if not sent.is_set():  # the router thread is spinning now: the request comes in meanwhile
                sent.set()
                dealer.send(b"ping")
            elif pauses > 50_000_000:  # pragma: no cover - never arrived: end the spin, fail below
                clock.now += 1.0

        clock.on_pause = send_once
        assert wait_until(lambda: len(got) == 1, 30)
        assert router.spin_hits == 1 and router.handled == 1


def test_the_router_never_spins_with_zero(endpoint: str) -> None:
    clock = FakeClock()
    spin = SpinPolicy(0, clock, clock.pause, clock)
    with _wired(endpoint, spin) as (router, dealer, got):
        for n in range(20):
            dealer.send(b"%d" % n)
        assert wait_until(lambda: len(got) == 20, 30)
        assert router.spin_hits == 0 and clock.pauses == 0


class _Polls:
    """select.poll, logging whether each poll found `target` readable."""

    def __init__(self) -> None:
        self.inner = select.poll()
        self.target = -1
        self.log: list[str] = []

    def register(self, fd: int, mask: int) -> None:
        self.inner.register(fd, mask)

    def unregister(self, fd: int) -> None:
        self.inner.unregister(fd)

    def poll(self, timeout: int = -1) -> list[tuple[int, int]]:
        events = self.inner.poll(timeout)
        if any(fd == self.target for fd, _ in events):
            self.log.append("readable")
        return events


def test_a_lane_request_caught_while_spinning_is_served_without_another_poll(endpoint: str) -> None:
    """The spin's own poll found the lane readable: the loop serves it from that poll's answer."""
    clock = FakeClock(step=0.0)  # frozen: the spin lasts until the request is there
    router = Router(
        lambda msg: None, lambda: None, sndhwm=100, spin=SpinPolicy(WINDOW_US, clock, clock.pause, clock)
    )
    polls = _Polls()
    router._poller = polls  # type: ignore[assignment]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    polls.target = ours.fileno()
    watching = threading.Event()

    def on_readable() -> int:
        polls.log.append(f"read {ours.recv(64)!r}")
        return 1

    def send_once(pauses: int) -> None:
        if watching.is_set() and not polls.log:
            theirs.send(b"request")

    clock.on_pause = send_once
    router.bind([endpoint])
    router.start()
    try:
        router.call_soon(lambda: (router.watch(ours.fileno(), on_readable), watching.set()))
        assert wait_until(lambda: "read b'request'" in polls.log, 30)
        assert polls.log[:2] == ["readable", "read b'request'"]
        assert router.spin_hits >= 1 and router.handled == 1
    finally:
        router.close()
        ours.close()
        theirs.close()
