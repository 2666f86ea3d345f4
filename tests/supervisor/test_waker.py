"""The supervisor loop's waker: woken from threads and from signal handlers without taking a lock."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from edgeserve.supervisor.waker import Waker


@pytest.fixture
def waker() -> Iterator[Waker]:
    made = Waker()
    yield made
    made.close()


def test_wait_reports_a_wake_from_another_thread_and_a_timeout(waker: Waker) -> None:
    assert waker.wait(0.0) is False
    threading.Thread(target=waker.set).start()
    assert waker.wait(60.0) is True  # generous: only a lost wake reaches it
    waker.clear()
    assert waker.wait(0.0) is False


def test_many_wakes_never_block_and_one_clear_takes_them_all(waker: Waker) -> None:
    for _ in range(200_000):  # far past a pipe's capacity: a full pipe is already a wake
        waker.set()
    assert waker.wait(0.0) is True
    waker.clear()
    assert waker.wait(0.0) is False


def test_a_wake_after_close_writes_nowhere() -> None:
    waker = Waker()
    waker.close()
    reused_read, reused_write = os.pipe()  # may get the waker's old descriptor numbers
    try:
        waker.set()
        os.set_blocking(reused_read, False)
        try:
            leaked = os.read(reused_read, 16)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
    finally:
        os.close(reused_read)
        os.close(reused_write)


LOOP = textwrap.dedent(
    """
    import signal, sys
    from edgeserve.supervisor.waker import Waker

    waker, pending = Waker(), []
    def on_signal(signum, frame):
        pending.append(signum)
        waker.set()
    signal.signal(signal.SIGHUP, on_signal)
    signal.signal(signal.SIGUSR1, on_signal)
    print("up", flush=True)
    hups = 0
    while True:  # the supervisor's loop: handle signals, work, wait, clear
        while pending:
            signum = pending.pop(0)
            hups += signum == signal.SIGHUP
            if signum == signal.SIGUSR1:
                print(f"alive after {hups} SIGHUPs", flush=True)
                sys.exit(0)
        waker.wait(0.5)
        waker.clear()
    """
)


def test_a_loop_flooded_with_signals_still_handles_them() -> None:
    """With a `threading.Event` woken from the handler this loop deadlocked now and then: the handler
    ran while the main thread held the Event's lock inside wait() or clear()."""
    child = subprocess.Popen([sys.executable, "-c", LOOP], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "up"
        sent = 0
        while sent < 3000:
            os.kill(child.pid, signal.SIGHUP)
            sent += 1
            time.sleep(0.0002)  # a handler runs before the next arrives (a nested one per signal)
        os.kill(child.pid, signal.SIGUSR1)
        # A deadlocked loop never answers; 60 s is generous for a loop that works on a saturated box.
        ready, _, _ = select.select([child.stdout], [], [], 60.0)
        assert ready, f"the loop did not answer SIGUSR1 after {sent} SIGHUPs: deadlocked"
        answer = child.stdout.readline()
        assert answer.startswith("alive after "), answer
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()
