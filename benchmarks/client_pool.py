"""Load from several client processes (bench_peers.py --client-processes P): the same callers as the
one-loop mode (peer_clients.py), spread over P persistent processes, each running its share of the N
concurrent clients on its own event loop. What several applications on the device look like (a
camera pipeline per process), and the load generator is no longer one Python thread sharing a core
with itself. Every side and transport gets the same processes, clients and concurrency.

One phase: every process opens its connections, reports ready, waits for the common start, runs its
clients until the phase's deadline or its share of the request budget, closes, and returns its
latencies. The parent measures CPU from the start to the last answer."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from common import Result, Workload

PHASE_SLACK_S = 120.0  # a process that has not answered this long after its deadline is broken


@dataclass(frozen=True)
class Phase:
    transport: str
    target: str
    work: Workload
    x: np.ndarray
    clients: int  # this process's share
    seconds: float
    max_requests: int  # this process's share


async def _run(phase: Phase, control: Connection) -> tuple[list[float], int, str, float]:
    from peer_clients import CALLERS

    caller = CALLERS[phase.transport](phase.target, phase.work, phase.x, phase.clients)
    await caller.open()
    latencies: list[float] = []
    errors, first_error = 0, ""
    try:
        control.send("ready")
        control.recv()  # the common start (blocking: nothing else runs on this loop meanwhile)
        t0 = time.perf_counter()
        deadline, left = t0 + phase.seconds, [phase.max_requests]

        async def client() -> None:
            nonlocal errors, first_error
            while left[0] > 0 and time.perf_counter() < deadline:
                left[0] -= 1
                start = time.perf_counter()
                try:
                    await caller()
                except Exception as exc:
                    errors += 1
                    first_error = first_error or repr(exc)
                    continue
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client() for _ in range(phase.clients)))
        seconds = time.perf_counter() - t0
    finally:
        await caller.close()
    return latencies, errors, first_error, seconds


def _serve(control: Connection) -> None:
    while True:
        phase = control.recv()
        if phase is None:
            return
        try:
            control.send(asyncio.run(_run(phase, control)))
        except Exception as exc:  # reported, and the pool carries on
            control.send(([], 1, repr(exc), 0.0))


class ClientPool:
    """P processes (spawned once, reused for every phase)."""

    def __init__(self, processes: int) -> None:
        context = mp.get_context("spawn")  # the parent holds threads (runtimes, gRPC): never fork it
        self.links: list[Connection] = []
        self.processes: list[Any] = []
        for _ in range(processes):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child,), daemon=True)
            process.start()
            self.links.append(parent)
            self.processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes]

    def run(self, label: str, transport: str, target: str, work: Workload, x: np.ndarray, clients: int,
            seconds: float, meter: Any = None) -> Result:  # fmt: skip
        """`clients` spread over the processes (the first ones take the remainder); processes with no
        share sit the phase out."""
        count = len(self.links)
        shares = [clients // count + (1 if i < clients % count else 0) for i in range(count)]
        active = [(link, share) for link, share in zip(self.links, shares, strict=True) if share]
        for link, share in active:
            budget = max(1, work.max_requests * share // clients)
            link.send(Phase(transport, target, work, x, share, seconds, budget))
        for link, _ in active:
            answer = link.recv() if link.poll(PHASE_SLACK_S) else "no answer"
            if answer != "ready":
                raise RuntimeError(f"a client process did not get ready for {label}: {answer}")
        if meter is not None:
            meter.start()
        for link, _ in active:
            link.send("go")
        result = Result(label, clients)
        for link, _ in active:
            if not link.poll(seconds + PHASE_SLACK_S):
                raise RuntimeError(f"a client process did not finish {label}")
            latencies, errors, first_error, took = link.recv()
            result.latencies_s += latencies
            result.errors += errors
            result.first_error = result.first_error or first_error
            result.seconds = max(result.seconds, took)
        if meter is not None:
            result.cpu = meter.stop()
        return result

    def close(self) -> None:
        for link in self.links:
            with contextlib.suppress(OSError):
                link.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
