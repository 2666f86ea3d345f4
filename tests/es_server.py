"""Start a real edgeserve server process on free loopback ports (used by tests and benchmarks).

Import from here, never `from conftest import ...` (conftest module names collide across folders)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from loopback_ports import free_port

ROOT = Path(__file__).resolve().parents[1]


class Endpoints:
    """Addresses and the log of a server started on free loopback ports (shared by the fixtures)."""

    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def model_ready(self, name: str) -> bool:
        return get_status(f"{self.base}/v2/models/{name}/ready") == 200

    def shm_regions(self) -> set[str]:
        """The shm region names registered now, as the server logs them (a client's status lists only
        the regions it may name itself: edgeserve/frontends/shm/binding.py)."""
        names: set[str] = set()
        for event, name in re.findall(r"shm region (registered|unregistered) name=(\S+)", self.log()):
            (names.add if event == "registered" else names.discard)(name)
        return names


@dataclass
class RunningServer(Endpoints):
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    zmq_endpoint: str
    log_path: Path
    repository: Path
    extra_env: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        return terminate(self.process, timeout)


def terminate(process: subprocess.Popen[bytes], timeout: float, *, tree: bool = False) -> int:
    """SIGTERM, and SIGKILL after `timeout` s (`tree`: its descendants first, e.g. a supervisor's server);
    the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            if tree:
                import psutil

                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
            process.kill()
            process.wait(10)
    return int(process.returncode)


# No listener on Triton's fixed metrics port 8002: servers run side by side (xdist workers, several
# suites), and the second one's "cannot listen" ERROR line became its supervisor's last error.
# --metrics-port wins over it.
SIDE_BY_SIDE_ENV = {"EDGESERVE_METRICS_PORT": "0"}


def server_command(command: str, repository: Path, http_port: int, grpc_port: int, zmq_endpoint: str,
                   extra: list[str]) -> list[str]:  # fmt: skip
    """`python -m edgeserve serve|run` on the given loopback ports (tests and benchmarks)."""
    return [sys.executable, "-m", "edgeserve", command, "--model-repository", str(repository),
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--zmq-endpoint", zmq_endpoint,
            *extra]  # fmt: skip


def get_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def scrape(base: str, prefix: str, timeout: float = 30.0) -> dict[str, float]:
    """GET {base}/metrics: the value of each series (its name with its labels) named `prefix`..."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    series = (line.rpartition(" ") for line in text.splitlines() if line.startswith(prefix))
    return {name: float(value) for name, _, value in series}


def start_server(
    repository: Path,
    tmp: Path,
    *,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    timeout: float = 120.0,
    command: str = "serve",
) -> RunningServer:
    """Start `python -m edgeserve serve` (or `run`: the supervisor) on free loopback ports and wait until
    it answers (ready by default)."""
    http_port, grpc_port = free_port(), free_port()
    zmq_endpoint = f"ipc://{tmp}/edgeserve-{http_port}.zmq"
    log_path = tmp / f"server-{http_port}.log"
    cmd = server_command(command, repository, http_port, grpc_port, zmq_endpoint, args or [])
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "EDGESERVE_SERVER_STATE_DIR": str(tmp / "state"),
        # no background race (hardware/race_background.py): a switch would reload a test's model under
        # it; tests/hardware/test_race_background.py tests it
        "EDGESERVE_RUNTIME_RACE_BACKGROUND": "false",
        # auto-completed models keep max_batch_size 4 (no batch-size race: what it serves depends on the
        # box's speed); tests/hardware/test_race_batch_server.py turns it on
        "EDGESERVE_RUNTIME_RACE_MAX_BATCH_SIZE": "0",
        **SIDE_BY_SIDE_ENV,
        **(env or {}),
    }
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    server = RunningServer(process, http_port, grpc_port, zmq_endpoint, log_path, repository, env or {})
    path = "/v2/health/ready" if wait_ready else "/v2/health/live"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"edgeserve exited with {process.returncode}:\n{server.log()}")
        if get_status(server.base + path) == 200:
            return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(
        f"edgeserve did not become {'ready' if wait_ready else 'live'} in {timeout}s:\n{server.log()}"
    )


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll `predicate` until it is true (True) or `timeout` seconds pass (its last answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


ServerFactory = Callable[..., RunningServer]


class Stoppable(Protocol):
    def stop(self, timeout: float = ...) -> int: ...


StartedT = TypeVar("StartedT", bound=Stoppable)


def stopped_after(start: Callable[..., StartedT], tmp_path: Path) -> Iterator[Callable[..., StartedT]]:
    """A fixture's body: `factory(repository, **kwargs)` is `start(repository, tmp_path, **kwargs)`, and
    whatever it started is stopped once the test is done."""
    started: list[StartedT] = []

    def factory(repository: Path, **kwargs: Any) -> StartedT:
        process = start(repository, tmp_path, **kwargs)
        started.append(process)
        return process

    yield factory
    for process in started:
        process.stop()
