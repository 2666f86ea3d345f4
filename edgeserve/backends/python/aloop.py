"""The worker's asyncio event loop, for `async def execute` / `initialize` / `finalize` (Triton's async
execute): one loop thread per worker process, started on the first coroutine. A decoupled model's
async execute is started there and left running (the next batch starts while it awaits), so many
requests are in flight at once; any other coroutine is run to its end while the caller waits.
asyncio is imported only when a model has a coroutine (it costs a worker a few MB).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from edgeserve.backends.python.pb_bls import Link

_loop: list[asyncio.AbstractEventLoop] = []
_lock = threading.Lock()
_running: set[Any] = set()  # started executes (a loop keeps only weak references)


def is_coroutine(value: Any) -> bool:
    return inspect.iscoroutine(value)


def loop() -> asyncio.AbstractEventLoop:
    import asyncio

    with _lock:
        if not _loop:
            new = asyncio.new_event_loop()
            threading.Thread(target=new.run_forever, name="edgeserve-model-loop", daemon=True).start()
            _loop.append(new)
        return _loop[0]


async def _in_context(coroutine: Any, link: Link | None) -> Any:
    from edgeserve.backends.python import pb_bls

    pb_bls.current.set(link)  # this task's own context: BLS calls and metrics find the model
    return await coroutine


def run(coroutine: Any, link: Link | None) -> Any:
    """Run a coroutine on the loop and wait for its result (its exception is raised here)."""
    import asyncio

    if _on_loop():
        coroutine.close()
        raise RuntimeError("a coroutine method called from the worker's event loop thread")
    return asyncio.run_coroutine_threadsafe(_in_context(coroutine, link), loop()).result()


def start(coroutine: Any, link: Link, done: Callable[[BaseException | None], None]) -> None:
    """Start a coroutine on the loop and return; `done(exception or None)` when it ends."""
    import asyncio

    future = asyncio.run_coroutine_threadsafe(_in_context(coroutine, link), loop())
    _running.add(future)

    def ended(finished: Any) -> None:
        _running.discard(finished)
        exc = finished.exception() if not finished.cancelled() else None
        done(exc)

    future.add_done_callback(ended)


def _on_loop() -> bool:
    import asyncio

    try:
        return asyncio.get_running_loop() is (_loop[0] if _loop else None)
    except RuntimeError:
        return False
