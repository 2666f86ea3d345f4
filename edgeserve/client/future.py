"""The future a `ZmqClient.submit` returns: waiting on it receives replies on the caller's thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Receives replies on the caller's thread until the future is done or `timeout` passes: the client's,
# handed over so that a future does not need to know the client.
Waiter = Callable[["ZmqFuture", float | None], None]


class ZmqFuture:
    """The eventual reply to one request; `result()` receives replies until this one is in."""

    __slots__ = ("_callbacks", "_done", "_error", "_result", "_wait", "id")

    def __init__(self, wait: Waiter, req_id: int) -> None:
        self._wait = wait
        self.id = req_id
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[ZmqFuture], None]] = []

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        """The result; raises ClientError for a failed request, TimeoutError if `timeout` (seconds)
        passes first (the request itself stays pending until its own deadline)."""
        if not self._done:
            self._wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._wait(self, timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[ZmqFuture], None]) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _set(self, result: Any, error: BaseException | None) -> None:
        self._done = True
        self._result = result
        self._error = error
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
