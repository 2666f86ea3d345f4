"""The server child process: start it, read its log lines, measure it, stop it gracefully or not."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from edgeserve.supervisor.notify import child_environment

log = logging.getLogger("edgeserve.supervisor")

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

# A server log line that names a failure; the latest one shows in `systemctl status`.
_ERROR_MARKS = (
    " ERROR ",
    " CRITICAL ",
    '"level": "ERROR"',
    '"level": "CRITICAL"',
    "Traceback",
    "edgeserve: ",
)


class ServerProcess:
    """One run of `edgeserve serve`; a new object per restart."""

    def __init__(
        self,
        serve_args: Sequence[str],
        control_socket: Path,
        state_dir: Path,
        log_line: Callable[[str], None],
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.control_socket = control_socket
        env = child_environment(os.environ)
        env["EDGESERVE_SERVER_STATE_DIR"] = str(state_dir)
        env["EDGESERVE_SUPERVISED_BY"] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(extra_env or {})
        with contextlib.suppress(FileNotFoundError):
            control_socket.unlink()
        self.command = [sys.executable, "-m", "edgeserve", "serve", *serve_args,
                        "--control-socket", str(control_socket)]  # fmt: skip
        self.started_at = time.monotonic()
        self.last_error = ""
        self.killed_for = ""
        self._log_line = log_line
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )
        self.pid = self.process.pid
        assert self.process.stdout is not None
        self._reader = threading.Thread(
            target=self._pump, args=(self.process.stdout,), name=f"server-log-{self.pid}", daemon=True
        )
        self._reader.start()

    def _pump(self, stream: IO[bytes]) -> None:
        """Forward the server's log lines into ours (one stream: journald or the rotated file)."""
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            if any(mark in line for mark in _ERROR_MARKS):
                self.last_error = line[-300:]
            self._log_line(line)
        stream.close()

    def poll(self) -> int | None:
        return self.process.poll()

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    def rss_mb(self) -> float | None:
        """Resident memory from /proc (no psutil in the supervisor); None once it has exited."""
        try:
            with open(f"/proc/{self.pid}/statm") as fh:
                resident_pages = int(fh.read().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return resident_pages * PAGE_KB / 1024

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def stop(self, grace_s: float, tick: Callable[[], None] | None = None) -> int:
        """SIGTERM (the server drains for up to its exit_timeout_s), SIGKILL after `grace_s`."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.process.poll() is None and time.monotonic() < deadline:
            if tick is not None:
                tick()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=0.2)
        if self.process.poll() is None:
            log.error("server pid %d did not stop within %.0fs; killing it", self.pid, grace_s)
            self.kill()
        return self.wait_exit()

    def kill(self, reason: str = "") -> None:
        """SIGKILL; `reason` (the supervisor's) outranks the server's own last error line."""
        if reason:
            self.killed_for = reason
        self.signal(signal.SIGKILL)

    def wait_exit(self) -> int:
        code = self.process.wait()
        self._reader.join(timeout=2)
        return code


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
