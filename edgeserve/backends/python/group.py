"""Python models of one trust level in one worker process (`python_worker_group`), seen from the server.

A model config's `parameters { key: "python_worker_group" value: { string_value: "ocr" } }` puts its
instances in the group's worker: one interpreter (numpy imported once) that serves each member on a
thread of its own, with the member's own control channel and shared-memory region as a worker of its
own would have. The server hands those two fds to the running worker over the group's channel
(SCM_RIGHTS on a SOCK_SEQPACKET socketpair) when an instance loads.

A group is keyed by its name and the origin of the models' code (`code_origin`): the folder the
model folders are in (the model repository, or one installed bundle's models folder) and that
folder's identity (device, inode), so a bundle's code never shares a process with local code or with
another bundle's, whatever the configs say.

Isolation inside a group is the process's: a crash, an os._exit / sys.exit, the OOM killer, or a
call past its hang timeout (the instance kills the worker) takes every member down at once; each
member then restarts at once (instance.py), the first one starting a new worker that the others
join. The worker exits when its last member goes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("edgeserve.backends.python")

GROUP_PARAMETER = "python_worker_group"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ATTACH_TIMEOUT_S = 30.0
MAX_GROUP_MESSAGE = 1 << 16


@dataclass(frozen=True)
class GroupKey:
    name: str
    origin: str  # the folder holding the model folders, resolved
    origin_id: tuple[int, int]  # (st_dev, st_ino) of that folder: a folder made again is another origin

    def label(self) -> str:
        return f"python_worker_group '{self.name}' ({self.origin})"


def check_group_name(name: str, where: str) -> str:
    """The group name a config gives, or ValueError naming the field and the fix."""
    if not _NAME.match(name):
        raise ValueError(
            f"{where}: parameters['{GROUP_PARAMETER}'] = {name!r}: use 1-64 letters, digits, '_', '-' or '.'"
        )
    return name


def code_origin(model_file: Path) -> tuple[str, tuple[int, int]]:
    """Where a Python model's code comes from: `<origin>/<model>/<version>/model.py` -> origin."""
    folder = model_file.resolve().parents[2]
    stat = folder.stat()
    return str(folder), (stat.st_dev, stat.st_ino)


def group_key(name: str, model_file: Path) -> GroupKey:
    origin, identity = code_origin(model_file)
    return GroupKey(name, origin, identity)


class GroupHost:
    """One running group worker: its process, its channel, how many members it serves."""

    def __init__(self, key: GroupKey, spawn: Callable[[list[str], tuple[int, ...]], subprocess.Popen[bytes]]):
        self.key = key
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            arguments = ["--group-fd", str(child.fileno()), "--label", key.label()]
            self.process = spawn(arguments, (child.fileno(),))
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        self.sock.settimeout(ATTACH_TIMEOUT_S)
        self.members = 0
        self._lock = threading.Lock()  # one attach at a time on the channel
        self._exit_callbacks: list[Callable[[], None]] = []
        threading.Thread(target=self._watch, name=f"edgeserve-python-group-{key.name}", daemon=True).start()
        log.info("%s: Python group worker pid %d started", key.label(), self.pid)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def attach(
        self, label: str, channel: socket.socket, region_fd: int, events: socket.socket, events_fd: int
    ) -> None:
        """Hand a member's channels and regions to the worker; OSError/ConnectionError when it is gone."""
        body = json.dumps({"op": "attach", "label": label}).encode()
        with self._lock:
            socket.send_fds(self.sock, [body], [channel.fileno(), region_fd, events.fileno(), events_fd])
            reply = self.sock.recv(MAX_GROUP_MESSAGE)
        if not reply:
            raise ConnectionError(f"the group worker (pid {self.pid}) closed its channel")
        answer = json.loads(reply)
        if not isinstance(answer, dict) or not answer.get("ok"):
            raise ConnectionError(f"the group worker refused the member: {answer}")

    def on_exit(self, callback: Callable[[], None]) -> None:
        """`callback()` once the process has exited (at once when it already has)."""
        with self._lock:
            if self.alive():
                self._exit_callbacks.append(callback)
                return
        callback()

    def _watch(self) -> None:
        self.process.wait()
        with self._lock:
            callbacks, self._exit_callbacks = self._exit_callbacks, []
        _forget(self)
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("%s: a member's exit handler failed", self.key.label())

    def kill(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`: every member goes with it."""
        stop(self.process, grace_s)

    def close(self, grace_s: float) -> None:
        """The last member went: closing the channel ends the worker; killed if it does not."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill(1.0)


def stop(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (a worker process, grouped or of its own)."""
    if process.poll() is None:
        with contextlib.suppress(OSError):
            process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10.0)


_hosts: dict[GroupKey, GroupHost] = {}
_hosts_lock = threading.Lock()


def join(key: GroupKey, spawn: Callable[[list[str], tuple[int, ...]], subprocess.Popen[bytes]]) -> GroupHost:
    """The group's running worker (started when there is none, or the last one died), one more member."""
    with _hosts_lock:
        host = _hosts.get(key)
        if host is None or not host.alive():
            host = GroupHost(key, spawn)
            _hosts[key] = host
        host.members += 1
        return host


def leave(host: GroupHost, grace_s: float) -> None:
    """One member less; the last one closes the worker."""
    with _hosts_lock:
        host.members -= 1
        last = host.members <= 0
        if last and _hosts.get(host.key) is host:
            del _hosts[host.key]
    if last:
        host.close(grace_s)


def _forget(host: GroupHost) -> None:
    with _hosts_lock:
        if _hosts.get(host.key) is host:
            del _hosts[host.key]


def running() -> list[GroupHost]:
    with _hosts_lock:
        return list(_hosts.values())
