"""The condition a model's workers wait on for jobs, waking the worker that went to sleep last.

threading.Condition.notify wakes the longest waiter, so with two instances and one request at a time
the requests alternate between them: each run finds the caches of an instance that sat idle for a
whole call (its activations, its thread's core). Waking the newest waiter keeps one instance busy
and warm while the load is light, as a stack of idle workers would; under load every worker runs
anyway. notify_all and wait are Condition's own.
"""

from __future__ import annotations

import threading
from typing import Any


class NewestFirst(threading.Condition):
    def notify(self, n: int = 1) -> None:
        waiters: Any = getattr(self, "_waiters", None)  # CPython's deque of waiters' locks, oldest first
        if waiters is None:  # another implementation: its own order
            super().notify(n)
            return
        if not self._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("cannot notify on un-acquired lock")
        while waiters and n > 0:
            waiter = waiters.pop()
            try:
                waiter.release()
            except RuntimeError:  # its wait already timed out
                continue
            n -= 1
