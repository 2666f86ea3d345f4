"""The shared daemon thread of openvino_memory's idle release and the scheduler's hang watchdog."""

from __future__ import annotations

import gc
import threading

from edgeserve.backends.watch_thread import WatchThread


class Item:
    pass


class Once(WatchThread[Item]):
    """Sees what it watches once, then ends (as the idle-release thread does when nothing waits)."""

    def __init__(self) -> None:
        super().__init__("test-watch")
        self.seen: list[int] = []
        self.go = threading.Event()
        self.runs = 0

    def _run(self) -> None:
        self.go.wait(10)
        self.runs += 1
        self.seen.append(len(self.watched()))
        with self._lock:
            self._thread = None


def test_one_thread_for_many_items_started_again_after_it_ended() -> None:
    watch = Once()
    first, second = Item(), Item()
    watch.add(first)
    thread = watch._thread
    watch.add(second)
    assert thread is not None and watch._thread is thread and thread.name == "test-watch" and thread.daemon
    watch.go.set()
    thread.join(10)
    assert watch.seen == [2] and watch._thread is None
    watch.add(first)
    again = watch._thread
    assert again is not None and again is not thread
    again.join(10)
    assert watch.runs == 2


def test_an_item_dropped_elsewhere_drops_out_of_the_watch() -> None:
    watch = Once()
    kept, dropped = Item(), Item()
    watch.add(kept)
    watch.add(dropped)
    thread = watch._thread
    del dropped
    gc.collect()
    assert watch.watched() == [kept]
    watch.go.set()
    assert thread is not None
    thread.join(10)
    assert watch.seen == [1]
