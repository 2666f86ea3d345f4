"""One worker process of a Python model, seen from the server: spawn, ask, kill.

The worker is a fresh interpreter (`python -m edgeserve.backends.python.worker`, never a fork of the
server, whose gRPC/ZeroMQ threads a fork would copy in a broken state) that inherits exactly four fds:
its end of a socketpair (the control channel) and the shared-memory file (wire.py), and its end of
the event channel and that channel's shared memory (channel.py). A model in a `python_worker_group`
gets the same four fds, handed to its group's running worker (group.py), and shares that process
with the group's other members.
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.backends import memory
from edgeserve.backends.python import channel, group, wire
from edgeserve.backends.python.events import Events
from edgeserve.backends.python.group import GroupKey

KILL_GRACE_S = 1.0
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
    group: GroupKey | None = None  # share the group's worker process (group.py)
    decoupled: bool = False  # model_transaction_policy { decoupled: true }


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


_live: weakref.WeakSet[Worker] = weakref.WeakSet()


def live_workers() -> list[tuple[int, str, str]]:
    """(pid, worker name, model name) of each model instance's worker that is up (for the memory
    breakdown: the members of a group share the group's pid and name)."""
    out = []
    for worker in list(_live):
        if not worker.alive():
            continue
        name = worker.host.key.label() if worker.host is not None else worker.spec.label
        out.append((worker.pid, name, worker.spec.args.get("model_name", "")))
    return out


def spawn(arguments: list[str], fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """A worker interpreter with `arguments`, inheriting `fds` (and nothing else)."""
    # glibc hands freed frame-sized arrays back to the kernel by default, so each call of a model
    # that allocates them page-faults them in again (5-8x slower on a 640x480 frame here); a
    # worker keeps some freed memory, as much as the memory profile allows (overridable).
    env = memory.worker_environment(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
    command = [sys.executable, "-m", "edgeserve.backends.python.worker", "--parent", str(os.getpid()),
               *arguments]  # fmt: skip
    return subprocess.Popen(command, pass_fds=fds, close_fds=True, env=env, stdin=subprocess.DEVNULL)


class Worker:
    """A started worker process (or a member of a group's). `request` is called by one thread at a
    time; `kill` from any."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.host: group.GroupHost | None = None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        label = spec.label.replace(" ", "_").replace("'", "")
        fd = wire.create_region_fd(label)
        events, events_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        events_fd = wire.create_region_fd(f"{label}-events", 2 * channel.HALF)  # sparse until written
        try:
            if spec.group is not None:
                self.host = group.join(spec.group, spawn)
                try:
                    self.host.attach(spec.label, child, fd, events_child, events_fd)
                except (OSError, ValueError):
                    group.leave(self.host, 1.0)
                    raise
                self.process = self.host.process
            else:
                arguments = ["--control-fd", str(child.fileno()), "--shm-fd", str(fd),
                             "--event-fd", str(events_child.fileno()), "--event-shm-fd", str(events_fd),
                             "--label", spec.label]  # fmt: skip
                self.process = spawn(arguments, (child.fileno(), fd, events_child.fileno(), events_fd))
        except BaseException:
            parent.close()
            events.close()
            os.close(fd)
            os.close(events_fd)
            raise
        finally:
            child.close()
            events_child.close()
        self.region = wire.Region(fd)
        self.events = channel.Channel(events, wire.Region(events_fd), "server", label)
        # reading from the start: initialize() may already declare metrics or call models
        self.dispatch = Events(self.events, spec.args.get("model_name", ""), spec.label, self.region)
        self.sock = parent
        self.sock.settimeout(READ_TIMEOUT_S)  # for the read once poll said a reply is there
        self._poller = select.poll()
        self._poller.register(parent.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        self._lock = threading.Lock()  # kill vs. cleanup
        self._closed = False
        _live.add(self)

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

    def on_exit(self, callback: Callable[[], None]) -> None:
        """A grouped worker: `callback()` once the group's process has exited (another member's crash
        takes this one down too). A worker of its own reports its death to the next call."""
        if self.host is not None:
            self.host.on_exit(callback)

    def kill(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reaps the process and frees the channel. A grouped
        worker's process is the group's: every member goes with it."""
        with self._lock:
            if self.host is not None:
                self.host.kill(grace_s)
            else:
                group.stop(self.process, grace_s)
            self._cleanup()

    def discard(self, grace_s: float) -> None:
        """Done with this worker, which is healthy: a grouped one just leaves its group (closing its
        channel ends its member thread), one of its own is killed."""
        if self.host is None:
            self.kill(grace_s)
            return
        with self._lock:
            self._cleanup()

    def stop(self, grace_s: float) -> None:
        """finalize() and a clean exit within `grace_s`, else kill. A grouped worker leaves its group
        (the worker process ends with its last member)."""
        try:
            self.request({"op": "finalize"}, grace_s)
            if self.host is None:
                self.process.wait(grace_s)
        except (WorkerDied, WorkerTimeout, WorkerStopped, subprocess.TimeoutExpired):
            pass
        self.discard(1.0)

    def _cleanup(self) -> None:  # lock held
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.region.close()
        self.events.close()
        self.events.sock.close()
        self.events.region.close()
        if self.host is not None:
            group.leave(self.host, KILL_GRACE_S)
