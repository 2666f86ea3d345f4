"""Add and remove execution instances of a running `Scheduler` (used by the autoscaler).

A removed instance's slot is retired, not deleted, so the indices the workers hold stay valid: its
generation is bumped (its worker exits, as for a hung instance being replaced), it sits in the
scheduler's `_replacing` set (never picked for an inline run) and holds a closed placeholder. A
later `grow` reuses a retired slot before it appends one, so the slot list never grows past the
most instances the model ever had. `shrink` only acts while the scheduler is fully idle (nothing
queued, nothing executing), so no batch is ever cut short.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance
    from edgeserve.scheduling.scheduler import Scheduler

JOIN_TIMEOUT_S = 5.0
_retired: weakref.WeakKeyDictionary[Scheduler, set[int]] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


class _Retired:
    """Stands in a retired slot: closing it is a no-op (the real instance was closed when retired)."""

    threads = 0

    def close(self) -> None:
        return None


def _slots(scheduler: Scheduler) -> set[int]:
    with _guard:
        return _retired.setdefault(scheduler, set())


def active_count(scheduler: Scheduler) -> int:
    """Instances serving (retired slots and instances being replaced after a hang not counted)."""
    with scheduler._lock:
        gone = _slots(scheduler) | scheduler._replacing
        return sum(1 for i in range(len(scheduler._instances)) if i not in gone)


def live_instances(scheduler: Scheduler) -> list[Instance]:
    with scheduler._lock:
        gone = _slots(scheduler)
        return [inst for i, inst in enumerate(scheduler._instances) if i not in gone]


def grow(scheduler: Scheduler, instance: Instance) -> bool:
    """Start serving `instance` in `scheduler` (a new worker thread). False when the scheduler is
    closing or not started: the caller closes the instance."""
    slots = _slots(scheduler)
    with scheduler._lock:
        if scheduler._closed or not scheduler._accepting or not scheduler._threads:
            return False
        if slots:
            index = min(slots)
            slots.discard(index)
            scheduler._replacing.discard(index)
            scheduler._instances[index] = instance
            thread = scheduler._make_thread(index, instance, scheduler._generation[index])
            scheduler._threads[index] = thread
        else:
            index = len(scheduler._instances)
            scheduler._instances.append(instance)
            scheduler._generation.append(0)
            thread = scheduler._make_thread(index, instance, 0)
            scheduler._threads.append(thread)
        thread.start()
        scheduler._work.notify_all()
    return True


def shrink(scheduler: Scheduler, minimum: int) -> Instance | None:
    """Retire the highest-numbered instance when more than `minimum` serve and the scheduler is
    idle; returns it for the caller to close (off the event loop), or None when nothing was done."""
    slots = _slots(scheduler)
    with scheduler._lock:
        if scheduler._closed or not scheduler._accepting or scheduler._queue or scheduler._executing:
            return None
        gone = slots | scheduler._replacing
        live = [i for i in range(len(scheduler._instances)) if i not in gone]
        if len(live) <= max(1, minimum):
            return None
        index = max(live)
        scheduler._generation[index] += 1  # its worker finds this and exits
        scheduler._replacing.add(index)
        slots.add(index)
        instance = scheduler._instances[index]
        scheduler._instances[index] = cast("Instance", _Retired())
        thread = scheduler._threads[index]
        scheduler._work.notify_all()
    if thread is not threading.current_thread():
        thread.join(JOIN_TIMEOUT_S)
    return instance
