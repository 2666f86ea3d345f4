"""What wakes the supervisor's loop: other threads and the signal handlers.

A Python signal handler runs on the main thread between two bytecodes, possibly while that thread
holds the internal lock of a `threading.Event` (inside its `wait()` or `clear()`). A handler calling
`Event.set()` then waits for a lock its own thread holds, forever: the supervisor stopped handling
SIGHUP after a few dozen reloads on a busy box. A self-pipe takes no lock: `set()` writes a byte,
`wait()` polls the read end.
"""

from __future__ import annotations

import contextlib
import os
import select


class Waker:
    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()  # not inherited by the children (PEP 446)
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)

    def set(self) -> None:
        """Safe from any thread and from a signal handler."""
        # A full pipe already wakes the loop; a closed one means the loop has ended.
        fd = self._write_fd
        if fd >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(fd, b"\0")

    def wait(self, timeout_s: float) -> bool:
        """True when woken, False when `timeout_s` passed first (a signal's handler wakes it too)."""
        return bool(self._poll.poll(max(0.0, timeout_s) * 1000.0))

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read_fd, 4096):
                pass

    def close(self) -> None:
        """After the loop ended; a late `set()` writes nowhere rather than to a reused descriptor."""
        fds = (self._write_fd, self._read_fd)
        self._write_fd = self._read_fd = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
