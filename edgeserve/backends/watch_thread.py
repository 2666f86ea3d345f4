"""A daemon thread shared by every object of a kind in the process, started when the first one is added
(and again when it ended), that holds them weakly: an object dropped elsewhere drops out of its watch."""

from __future__ import annotations

import threading
import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class WatchThread(Generic[T]):
    """Subclasses say what `_run` does with `watched()`; a `_run` that returns sets `_thread` to None
    under `_lock` first, so the next `add` starts a new one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._items: weakref.WeakSet[T] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def add(self, item: T) -> None:
        with self._lock:
            self._items.add(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def watched(self) -> list[T]:
        with self._lock:
            return list(self._items)

    def _run(self) -> None:
        raise NotImplementedError
