"""The load drivers and the measurement loop.

Concurrency N: N workers, each sends its next request as soon as its last one is answered (closed
loop). Request rate R: arrivals drawn from a Poisson process (exponential gaps, mean 1/R) and sent
on time whatever is in flight (open loop); an arrival the event loop could not send within 1 ms of its
time is counted as `late`. Every point: a warm-up, then windows of `window_s` until the last three
agree (perf_analyzer's stability rule) or `max_windows` ran; the point is the merge of its last three.
All on one asyncio event loop, with monotonic clocks; every task started here is stopped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgeserve.bench.api import GrpcApi, HttpApi, ServerApi, ZmqApi
from edgeserve.bench.errors import BenchError, RequestError
from edgeserve.bench.inputs import ModelInfo, Sample, make_samples, resolve_shapes
from edgeserve.bench.stats import Counters, Point, Window, merge, stable
from edgeserve.bench.transports import TRANSPORTS, Transport

Progress = Callable[[str], None]
LATE_S = 0.001
ERROR_PAUSE_S = 0.01  # a worker whose request failed waits this long: a dead server is not a busy loop


@dataclass
class Settings:
    warmup_s: float = 1.0
    window_s: float = 2.0
    stability_pct: float = 10.0
    max_windows: int = 10
    timeout_s: float = 30.0
    rate_lanes: int = 4  # clients (channels, streams, sockets) the Poisson arrivals are spread over
    max_inflight: int = 1024  # Poisson mode: more in flight counts as an error, not as more memory
    seed: int = 0


@dataclass
class BenchConfig:
    model: str
    protocol: str = "grpc"
    url: str = ""  # "" = the protocol's default address
    stats_url: str | None = "127.0.0.1:8000"  # ZeroMQ only: the HTTP endpoint for config/statistics
    version: str = ""
    batch_size: int = 1
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    input_data: Sequence[str] = ("random",)
    concurrency: Sequence[int] = (1,)
    request_rates: Sequence[float] = ()
    settings: Settings = field(default_factory=Settings)
    max_seconds: float = 300.0
    headers: dict[str, str] = field(default_factory=dict)  # -H: on every HTTP / gRPC call


DEFAULT_URLS = {
    "http": "127.0.0.1:8000",
    "http-json": "127.0.0.1:8000",
    "grpc": "127.0.0.1:8001",
    "grpc-stream": "127.0.0.1:8001",
}


def default_url(protocol: str) -> str:
    if protocol.startswith("zmq"):
        from edgeserve.client.endpoint import find_endpoint

        return find_endpoint()
    return DEFAULT_URLS[protocol]


def server_api(config: BenchConfig, url: str) -> ServerApi:
    timeout = config.settings.timeout_s
    if config.protocol.startswith("http"):
        return HttpApi(url, timeout, config.headers)
    if config.protocol.startswith("grpc"):
        return GrpcApi(url, timeout, config.headers)
    return ZmqApi(url, config.stats_url, timeout)


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors = self.sent = self.late = 0
        self.first_error = ""

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.first_error = self.first_error or str(exc)

    def mark(self) -> tuple[int, int, int, int]:
        return len(self.latencies), self.errors, self.sent, self.late


async def _one(transport: Transport, rec: _Recorder, lane: int, index: int) -> bool:
    rec.sent += 1
    t0 = time.perf_counter()
    try:
        await transport.infer(lane, index)
    except RequestError as exc:
        rec.failed(exc)
        return False
    rec.latencies.append(time.perf_counter() - t0)
    return True


async def _closed_loop(
    transport: Transport, rec: _Recorder, lane: int, lanes: int, stop: asyncio.Event
) -> None:
    index = lane
    while not stop.is_set():
        if not await _one(transport, rec, lane, index):
            await asyncio.sleep(ERROR_PAUSE_S)
        index += lanes


async def _open_loop(
    transport: Transport, rec: _Recorder, rate: float, settings: Settings, stop: asyncio.Event
) -> None:
    rng = np.random.default_rng(settings.seed)
    inflight: set[asyncio.Task[bool]] = set()
    loop = asyncio.get_running_loop()
    due = time.perf_counter()
    index = 0
    try:
        while not stop.is_set():
            due += float(rng.exponential(1.0 / rate))
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -LATE_S:
                rec.late += 1
            if stop.is_set():
                break
            if len(inflight) >= settings.max_inflight:
                rec.sent += 1
                rec.failed(
                    RequestError(
                        f"over {settings.max_inflight} requests in flight: the server is not keeping up"
                    )
                )
                continue
            task = loop.create_task(_one(transport, rec, index % settings.rate_lanes, index))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            index += 1
    finally:
        if inflight:
            _, left = await asyncio.wait(inflight, timeout=settings.timeout_s)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)


async def measure_point(
    transport: Transport,
    api: ServerApi,
    info: ModelInfo,
    config: BenchConfig,
    *,
    concurrency: int = 0,
    rate: float = 0.0,
    deadline: float,
    progress: Progress,
) -> Point:
    """One load point: warm-up, windows until stable, the merged result."""
    s = config.settings
    label = f"c={concurrency}" if concurrency else f"rate={rate:g}/s"
    lanes = concurrency if concurrency else s.rate_lanes
    try:
        await transport.open(lanes, 1 if concurrency else max(1, s.max_inflight // lanes))
    except BaseException:
        await transport.close()
        raise
    rec, stop = _Recorder(), asyncio.Event()
    loop = asyncio.get_running_loop()
    if concurrency:
        tasks = [loop.create_task(_closed_loop(transport, rec, i, lanes, stop)) for i in range(lanes)]
    else:
        tasks = [loop.create_task(_open_loop(transport, rec, rate, s, stop))]
    windows: list[Window] = []
    is_stable = False
    try:
        await asyncio.sleep(max(0.0, min(s.warmup_s, deadline - time.perf_counter())))
        mark, t0, cpu0 = rec.mark(), time.perf_counter(), time.process_time()
        before = await api.counters(info.name, info.version)
        while len(windows) < s.max_windows:
            left = deadline - time.perf_counter()
            if windows and left < s.window_s / 2:
                progress(f"{label}: time limit reached after {len(windows)} window(s)")
                break
            await asyncio.sleep(max(0.05, min(s.window_s, left)))
            t1, cpu1, now = time.perf_counter(), time.process_time(), rec.mark()
            after = await api.counters(info.name, info.version)
            server: Counters | None = after - before if after is not None and before is not None else None
            window = Window(
                t1 - t0,
                rec.latencies[mark[0] : now[0]],
                now[1] - mark[1],
                now[2] - mark[2],
                now[3] - mark[3],
                cpu1 - cpu0,
                server,
            )
            windows.append(window)
            is_stable = stable(windows, s.stability_pct)
            lat = sorted(window.latencies_s)
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else float("nan")
            progress(
                f"{label} window {len(windows)}/{s.max_windows}: "
                f"{window.throughput * config.batch_size:.1f} infer/s, "
                f"avg {window.avg_latency_s * 1e3:.2f} ms, p99 {p99:.2f} ms, errors {window.errors}"
                + (" - stable" if is_stable else "")
            )
            if is_stable:
                break
            mark, t0, cpu0, before = now, t1, cpu1, after
    finally:
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=s.timeout_s + 1) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await transport.close()
    if not windows:
        raise BenchError(f"{label}: no measurement window fitted in the time limit")
    point = merge(
        windows[-3:],
        protocol=config.protocol,
        model=info.name,
        batch_size=config.batch_size,
        concurrency=concurrency,
        request_rate=rate,
        stable_now=is_stable,
        windows_run=len(windows),
        first_error=rec.first_error,
    )
    progress(
        f"{label}: {point.throughput:.1f} infer/s, p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f} ms, "
        f"errors {point.errors}"
        + ("" if is_stable else " (not stable)")
        + (f"; first error: {point.first_error}" if point.first_error else "")
    )
    return point


@dataclass
class BenchRun:
    info: ModelInfo
    points: list[Point]
    samples: list[Sample]


async def run_bench(
    config: BenchConfig, progress: Progress, stop_after: Callable[[list[Point]], bool] | None = None
) -> BenchRun:
    """Everything `edgeserve bench` measures: one point per concurrency level, then per rate;
    `stop_after(points)` true ends the sweep early (tune: past the latency budget)."""
    if config.protocol not in TRANSPORTS:
        raise BenchError(f"unknown protocol {config.protocol!r}; use one of {', '.join(TRANSPORTS)}")
    deadline = time.perf_counter() + config.max_seconds
    url = config.url or default_url(config.protocol)
    api = server_api(config, url)
    try:
        info = await asyncio.wait_for(
            api.model_info(config.model, config.version), config.settings.timeout_s + 5
        )
        shapes = resolve_shapes(info, config.batch_size, config.shapes)
        samples = make_samples(info, shapes, list(config.input_data), config.settings.seed)
        shown = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
        progress(f"{info.name} v{info.version or '?'} over {config.protocol} at {url}: inputs {shown}")
        points: list[Point] = []
        loads = [(c, 0.0) for c in config.concurrency] + [(0, r) for r in config.request_rates]
        for i, (concurrency, rate) in enumerate(loads):
            if time.perf_counter() >= deadline:
                progress(
                    f"time limit ({config.max_seconds:g} s) reached: {len(loads) - i} load point(s) not run"
                )
                break
            transport = TRANSPORTS[config.protocol](
                url, info, samples, config.settings.timeout_s, config.headers
            )
            points.append(
                await measure_point(
                    transport,
                    api,
                    info,
                    config,
                    concurrency=concurrency,
                    rate=rate,
                    deadline=deadline,
                    progress=progress,
                )
            )
            if stop_after is not None and i + 1 < len(loads) and stop_after(points):
                break
        return BenchRun(info, points, samples)
    except asyncio.TimeoutError:
        raise BenchError(f"no answer from {url} in {config.settings.timeout_s + 5:g} s") from None
    finally:
        with contextlib.suppress(Exception):
            await api.close()
