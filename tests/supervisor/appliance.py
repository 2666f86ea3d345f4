"""`edgeserve run` (supervisor + server) on free loopback ports, with a real notify socket bound by the
test: every datagram systemd would get is recorded with its arrival time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from es_server import ROOT, SIDE_BY_SIDE_ENV, Endpoints, free_port, get_status, server_command, terminate
from notify_socket import NotifyListener


@dataclass
class Appliance(Endpoints):
    process: subprocess.Popen[bytes]
    notify: NotifyListener
    http_port: int
    grpc_port: int
    zmq_endpoint: str
    log_path: Path
    config_path: Path
    started_at: float = field(default_factory=time.monotonic)

    def server_pid(self, timeout: float = 30.0, not_pid: int | None = None) -> int:
        """The current server child's pid (a new one when `not_pid` is given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.process.pid).children():
                    if child.pid != not_pid and child.status() != psutil.STATUS_ZOMBIE:
                        return int(child.pid)
            time.sleep(0.05)
        raise AssertionError(f"no server child (other than {not_pid}) within {timeout}s:\n{self.log()}")

    def get(self, path: str, timeout: float = 5.0) -> int | None:
        return get_status(self.base + path, timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get("/v2/health/ready", timeout=2) == 200:
                return
            assert self.process.poll() is None, f"supervisor exited:\n{self.log()}"
            time.sleep(0.1)
        raise AssertionError(f"not ready within {timeout}s:\n{self.log()}")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self, timeout: float = 60.0) -> int:
        code = terminate(self.process, timeout, tree=True)
        self.notify.close()
        return code


ApplianceFactory = Callable[..., Appliance]


def start_appliance(
    repository: Path,
    tmp: Path,
    *,
    config: str = "",
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    watchdog_usec: int | None = None,
    abstract_notify: bool = False,
    http_port: int | None = None,
) -> Appliance:
    """Start `python -m edgeserve run`; returns at once (wait on `notify` or `wait_ready`)."""
    http_port = http_port or free_port()
    grpc_port = free_port()
    zmq_endpoint = f"ipc://{tmp}/es-{http_port}.zmq"
    config_path = tmp / f"edgeserve-{http_port}.toml"
    config_path.write_text(config)
    notify = (
        NotifyListener(abstract=f"edgeserve-test-{os.getpid()}-{http_port}")
        if abstract_notify
        else NotifyListener(tmp / f"notify-{http_port}.sock")
    )
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NOTIFY_SOCKET": notify.address,
        "EDGESERVE_SERVER_STATE_DIR": str(tmp / "state"),
        **SIDE_BY_SIDE_ENV,
        **(env or {}),
    }
    full_env.pop("WATCHDOG_USEC", None)
    if watchdog_usec:
        full_env["WATCHDOG_USEC"] = str(watchdog_usec)
    command = server_command("run", repository, http_port, grpc_port, zmq_endpoint,
                             ["--config", str(config_path), *(args or [])])  # fmt: skip
    log_path = tmp / f"appliance-{http_port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    return Appliance(process, notify, http_port, grpc_port, zmq_endpoint, log_path, config_path)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
