"""One worker process of a Python model, seen from the server: spawn, ask, kill.

The worker is a fresh interpreter (`python -m edgeserve.backends.python.worker`, never a fork of the
server, whose gRPC/ZeroMQ threads a fork would copy in a broken state) that inherits exactly two fds:
its end of a socketpair (the control channel) and the shared-memory file (wire.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.backends.python import wire

POLL_SLICE_S = 0.1  # how often a wait looks at the process and the stop flag
READ_TIMEOUT_S = 30.0  # a reply whose first bytes arrived must arrive whole within this
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding edgeserve/


class WorkerDied(Exception):
    """The worker exited (or closed its channel) before it answered; the text says how."""


class WorkerTimeout(Exception):
    """The worker did not answer in time (still running: the caller decides to kill it)."""


class WorkerStopped(Exception):
    """The instance is closing: the wait was abandoned."""


@dataclass(frozen=True)
class WorkerSpec:
    model_file: Path
    label: str  # "model 'add_sub' version 1 instance 0", for messages
    args: dict[str, str] = field(default_factory=dict)  # initialize(args), as Triton builds it
    call_timeout_s: float = 0.0  # 0 = no limit on one execute
    start_timeout_s: float = 300.0  # import + initialize


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "closed its control channel"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (signal {-returncode})"
    return f"exited with code {returncode}"


class Worker:
    """A started worker process. `request` is called by one thread at a time; `kill` from any."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = wire.create_region_fd(spec.label.replace(" ", "_").replace("'", ""))
        env = dict(os.environ)
        # glibc hands freed frame-sized arrays back to the kernel by default, so each call of a model
        # that allocates them page-faults them in again (5-8x slower on a 640x480 frame here); a
        # worker is one model's process, so it keeps up to this much freed memory (overridable).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(64 << 20))
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
        command = [sys.executable, "-m", "edgeserve.backends.python.worker", "--control-fd",
                   str(child.fileno()), "--shm-fd", str(fd), "--parent", str(os.getpid()),
                   "--label", spec.label]  # fmt: skip
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(child.fileno(), fd), close_fds=True, env=env, stdin=subprocess.DEVNULL
            )
        except BaseException:
            parent.close()
            os.close(fd)
            raise
        finally:
            child.close()
        self.sock = parent
        self.sock.settimeout(READ_TIMEOUT_S)  # for the read once poll said a reply is there
        self.region = wire.Region(fd)
        self._poller = select.poll()
        self._poller.register(parent.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        self._lock = threading.Lock()  # kill vs. cleanup
        self._closed = False

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def exit_text(self) -> str:
        try:
            code: int | None = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return describe_exit(code)

    def request(
        self, message: dict[str, Any], timeout_s: float, stop: threading.Event | None = None
    ) -> wire.Header:
        """Send `message`, wait for the reply. Raises WorkerDied, WorkerTimeout or WorkerStopped."""
        try:
            wire.send(self.sock, message)
        except OSError:
            raise WorkerDied(self.exit_text()) from None
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        poller = self._poller
        while True:
            if stop is not None and stop.is_set():
                raise WorkerStopped()
            wait = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
            if wait <= 0:
                raise WorkerTimeout()
            try:
                ready = poller.poll(wait * 1000)
            except (OSError, ValueError):
                ready = [(-1, select.POLLHUP)]  # the socket was closed under us (kill)
            if ready:
                break
            if self.process.poll() is not None:  # died without closing (a child of it holds the fd)
                raise WorkerDied(self.exit_text())
        try:
            reply = wire.recv(self.sock)
        except (wire.PeerGone, OSError, ValueError):
            if stop is not None and stop.is_set():
                raise WorkerStopped() from None
            raise WorkerDied(self.exit_text()) from None
        size = int(reply.get("size", 0) or 0)
        self.region.follow(size)
        return reply

    def kill(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reaps the process and frees the channel."""
        with self._lock:
            if self.process.poll() is None:
                with contextlib.suppress(OSError):
                    self.process.terminate()
                try:
                    self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(OSError):
                        self.process.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(10.0)
            self._cleanup()

    def stop(self, grace_s: float) -> None:
        """finalize() and a clean exit within `grace_s`, else kill."""
        try:
            self.request({"op": "finalize"}, grace_s)
            self.process.wait(grace_s)
        except (WorkerDied, WorkerTimeout, WorkerStopped, subprocess.TimeoutExpired):
            pass
        self.kill(1.0)

    def _cleanup(self) -> None:  # lock held
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.region.close()
