"""Shared helpers for the side-by-side benchmarks: percentiles, a server process on free loopback
ports, bounded client loops (threads or asyncio), the CPU share of each side, progress lines.

Every loop is bounded by a request count and a time limit and stops by itself; only the processes
started here are stopped, by their process id. The server is started by tests/es_server.py, the same
helper the end-to-end tests use.
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from es_server import RunningServer, free_port  # noqa: E402
from es_server import start_server as _start_server  # noqa: E402

__all__ = ["ROOT", "CpuMeter", "Result", "RunningServer", "free_port", "merge", "percentile", "progress",
           "run_async", "run_threads", "start_server"]  # fmt: skip


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
def start_server(repository: Path, models: list[str], extra_args: list[str] | None = None,
                 timeout: float = 180.0) -> RunningServer:  # fmt: skip
    """`python -m edgeserve run` with only HTTP, on a free loopback port, loading only `models`
    (tests/es_server.py starts it; stop it with `.stop()`, which signals that process only)."""
    tmp = Path(tempfile.mkdtemp(prefix="edgeserve-bench-"))
    args = ["--no-grpc", "--no-zmq", "--log-level", "WARNING"]
    for model in models:
        args += ["--load-model", model]
    return _start_server(repository, tmp, args=args + (extra_args or []), timeout=timeout)
