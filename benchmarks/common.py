"""Shared helpers for the side-by-side benchmarks: percentiles, a server process on free loopback
ports, bounded client loops (threads or asyncio), the CPU share of each side, progress lines.

Every loop is bounded by a request count and a time limit and stops by itself; only the processes
started here are stopped, by their process id.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# -- CPU accounting ---------------------------------------------------------------------------------------
class CpuMeter:
    """CPU used by processes between start() and stop(), as a share of the whole machine (all cores)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    @staticmethod
    def _used(process: psutil.Process) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._start = {name: self._used(p) for name, p in self.processes.items()}

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        cores = psutil.cpu_count() or 1
        return {
            name: 100.0 * (self._used(p) - self._start[name]) / (wall * cores)
            for name, p in self.processes.items()
        }


# -- results -----------------------------------------------------------------------------------------------
@dataclass
class Result:
    label: str
    clients: int
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    first_error: str = ""

    @property
    def throughput(self) -> float:
        return len(self.latencies_s) / self.seconds if self.seconds else 0.0

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_s, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_s, 99) * 1e3


def merge(parts: list[Result]) -> Result:
    """One result from interleaved slices of the same run (CPU shares weighted by slice time)."""
    total = Result(parts[0].label, parts[0].clients)
    for part in parts:
        total.latencies_s += part.latencies_s
        total.errors += part.errors
        total.seconds += part.seconds
        total.first_error = total.first_error or part.first_error
        for name, share in part.cpu.items():
            total.cpu[name] = total.cpu.get(name, 0.0) + share * part.seconds
    total.cpu = {name: value / total.seconds for name, value in total.cpu.items()} if total.seconds else {}
    return total


class _Budget:
    """Shared across workers: stop after `max_requests` started or `max_seconds` elapsed."""

    def __init__(self, max_requests: int, max_seconds: float) -> None:
        self.left = max_requests
        self.deadline = time.perf_counter() + max_seconds
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left <= 0 or time.perf_counter() >= self.deadline:
                return False
            self.left -= 1
            return True


def run_threads(
    label: str,
    call: Callable[[], None],
    clients: int,
    max_requests: int,
    max_seconds: float,
    meter: CpuMeter | None = None,
) -> Result:
    """`clients` threads each calling `call()` back to back until the shared budget runs out."""
    result = Result(label, clients)
    budget = _Budget(max_requests, max_seconds)
    lock = threading.Lock()

    def worker() -> None:
        local: list[float] = []
        while budget.take():
            t0 = time.perf_counter()
            try:
                call()
            except Exception as exc:
                with lock:
                    result.errors += 1
                    result.first_error = result.first_error or repr(exc)
                continue
            local.append(time.perf_counter() - t0)
        with lock:
            result.latencies_s.extend(local)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    if meter:
        meter.start()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 60)
    result.seconds = time.perf_counter() - t0
    if meter:
        result.cpu = meter.stop()
    return result


def run_async(
    label: str,
    call: Callable[[], Awaitable[None]],
    clients: int,
    max_requests: int,
    max_seconds: float,
    meter: CpuMeter | None = None,
    setup: Callable[[], Awaitable[None]] | None = None,
    teardown: Callable[[], Awaitable[None]] | None = None,
) -> Result:
    """`clients` concurrent asyncio tasks on one event loop (one load-generator thread); `setup` and
    `teardown` run in that loop, outside the measurement."""
    result = Result(label, clients)
    budget = _Budget(max_requests, max_seconds)

    async def worker() -> None:
        while budget.take():
            t0 = time.perf_counter()
            try:
                await call()
            except Exception as exc:
                result.errors += 1
                result.first_error = result.first_error or repr(exc)
                continue
            result.latencies_s.append(time.perf_counter() - t0)

    async def main() -> None:
        if setup is not None:
            await setup()
        try:
            if meter:
                meter.start()
            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), max_seconds + 60)
            result.seconds = time.perf_counter() - t0
            if meter:
                result.cpu = meter.stop()
        finally:
            if teardown is not None:
                await teardown()

    asyncio.run(main())
    return result


# -- the server process ------------------------------------------------------------------------------------
def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    http_port: int
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_server(
    repository: Path, models: list[str], extra_args: list[str] | None = None, timeout: float = 180.0
) -> ServerProcess:
    """`python -m edgeserve run` with only HTTP on a free loopback port, serving `models`."""
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"edgeserve-bench-{port}.log"
    flags = f"--http-port {port} --host 127.0.0.1 --no-grpc --no-zmq --log-level WARNING".split()
    cmd = [sys.executable, "-m", "edgeserve", "run", "--model-repository", str(repository), *flags]
    for model in models:
        cmd += ["--load-model", model]
    cmd += extra_args or []
    state = Path(tempfile.gettempdir()) / f"edgeserve-bench-{port}"
    env = {**os.environ, "EDGESERVE_SERVER_STATE_DIR": str(state)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"edgeserve exited with {process.returncode}; log: {log_path}")
        if _ready(server.base + "/v2/health/ready"):
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"edgeserve was not ready within {timeout:.0f}s; log: {log_path}")
