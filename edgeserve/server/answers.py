"""How a data plane answer reaches an event loop: `on_loop` (a callback run on the loop's thread) and
`LoopAnswer` (`DataPlane.infer`'s one answer)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from edgeserve.protocol.errors import InferenceError
from edgeserve.protocol.inference import InferResponse

ResponseCallback = Callable[["InferResponse | InferenceError"], None]
_T = TypeVar("_T")


def on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[_T], None]) -> Callable[[_T], None]:
    """`callback` run on `loop`'s thread: directly when called there (an inline run, an immediate
    refusal), else through `call_soon_threadsafe` (a worker thread). RuntimeError when the loop is
    closed (the server is gone and nobody waits)."""
    here = threading.get_ident()

    def call(result: _T) -> None:
        if threading.get_ident() == here:
            callback(result)
        else:
            loop.call_soon_threadsafe(callback, result)

    return call


class LoopAnswer:
    """`DataPlane.infer`'s answer, settled on the loop (`deliver`, through `on_loop`): one given
    while `submit` runs (an inline run, a refusal) is kept for `infer` to return without a future;
    a later one (from a worker) resolves `future`."""

    __slots__ = ("deliver", "future", "loop", "result")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.result: InferResponse | InferenceError | None = None
        self.future: asyncio.Future[InferResponse] | None = None
        self.deliver: ResponseCallback = on_loop(loop, self._settle)

    def _settle(self, result: InferResponse | InferenceError) -> None:
        # `deliver` holds this method, so the answer was in a reference cycle with it: with the result
        # (the output tensors) in the cycle, a response lived until the cyclic GC ran (seen: hundreds
        # of MB of frames kept on an idle server). Settled once: the cycle goes now.
        self.deliver = _settled
        future = self.future
        if future is None:  # still inside `submit` (the future is made before any worker answer lands)
            if self.result is None:
                self.result = result
        elif not future.done():
            if isinstance(result, InferenceError):
                future.set_exception(result)
            else:
                future.set_result(result)


def _settled(result: InferResponse | InferenceError) -> None:
    """An answer's `deliver` once it was settled (on_done is called once; a second call is dropped)."""
