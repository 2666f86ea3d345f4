"""NewestFirst: the worker that went to sleep last is woken first (its instance is the warm one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sched_helpers import WAIT_S

from edgeserve.scheduling.wakeups import NewestFirst


def _until(condition: threading.Condition, predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        with condition:  # taking the lock means every waiter seen so far is inside wait()
            if predicate():
                return
        assert time.monotonic() < deadline, "the waiters never got there"
        time.sleep(0.001)


def test_notify_wakes_the_newest_waiter_and_notify_all_wakes_the_rest() -> None:
    condition = NewestFirst(threading.Lock())
    waiting: list[str] = []
    woken: list[str] = []

    def worker(name: str) -> None:
        with condition:
            waiting.append(name)
            condition.wait(WAIT_S)
            woken.append(name)

    threads = []
    for count, name in enumerate(("oldest", "middle", "newest"), 1):
        thread = threading.Thread(target=worker, args=(name,))
        thread.start()
        threads.append(thread)
        _until(condition, lambda count=count: len(waiting) == count)  # type: ignore[misc]
    with condition:
        condition.notify()
    _until(condition, lambda: len(woken) == 1)
    assert woken == ["newest"]
    with condition:
        condition.notify()
    _until(condition, lambda: len(woken) == 2)
    assert woken == ["newest", "middle"]
    with condition:
        condition.notify_all()
    for thread in threads:
        thread.join(WAIT_S)
    assert woken == ["newest", "middle", "oldest"]
