"""Figures of one measurement: latency percentiles, the server-side split from statistics deltas,
windows, perf_analyzer's stability rule and the merged result of one load point."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

_SPLIT = ("queue", "compute_input", "compute_infer", "compute_output")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of Triton's statistics extension, summed over the model's versions."""

    success: int = 0
    fail: int = 0
    executions: int = 0
    ns: Mapping[str, int] = field(default_factory=dict)  # queue / compute_* total ns
    counts: Mapping[str, int] = field(default_factory=dict)  # queue / compute_* counts

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Counters | None:
        entries = body.get("model_stats")
        if not isinstance(entries, list) or not entries:
            return None
        success = fail = executions = 0
        ns = dict.fromkeys(_SPLIT, 0)
        counts = dict.fromkeys(_SPLIT, 0)
        for entry in entries:
            stats = entry.get("inference_stats") or {}
            success += _int((stats.get("success") or {}).get("count"))
            fail += _int((stats.get("fail") or {}).get("count"))
            executions += _int(entry.get("execution_count"))
            for key in _SPLIT:
                ns[key] += _int((stats.get(key) or {}).get("ns"))
                counts[key] += _int((stats.get(key) or {}).get("count"))
        return cls(success, fail, executions, ns, counts)

    def __sub__(self, before: Counters) -> Counters:
        return Counters(
            self.success - before.success,
            self.fail - before.fail,
            self.executions - before.executions,
            {k: self.ns.get(k, 0) - before.ns.get(k, 0) for k in _SPLIT},
            {k: self.counts.get(k, 0) - before.counts.get(k, 0) for k in _SPLIT},
        )

    def __add__(self, other: Counters) -> Counters:
        return Counters(
            self.success + other.success,
            self.fail + other.fail,
            self.executions + other.executions,
            {k: self.ns.get(k, 0) + other.ns.get(k, 0) for k in _SPLIT},
            {k: self.counts.get(k, 0) + other.counts.get(k, 0) for k in _SPLIT},
        )

    def per_request_us(self) -> dict[str, float]:
        """Average µs per request of each part (Triton counts a batch's compute for each request)."""
        return {k: self.ns[k] / self.counts[k] / 1e3 if self.counts.get(k) else math.nan for k in _SPLIT}


@dataclass
class Window:
    """What finished in one measurement window."""

    seconds: float
    latencies_s: list[float]
    errors: int
    sent: int
    late: int
    cpu_s: float
    server: Counters | None

    @property
    def throughput(self) -> float:  # requests per second
        return len(self.latencies_s) / self.seconds if self.seconds > 0 else 0.0

    @property
    def avg_latency_s(self) -> float:
        return sum(self.latencies_s) / len(self.latencies_s) if self.latencies_s else math.nan


def stable(windows: Sequence[Window], pct: float) -> bool:
    """perf_analyzer's rule: the last 3 windows' throughput and average latency each within `pct` %
    of their mean."""
    if len(windows) < 3:
        return False
    last = windows[-3:]
    for values in ([w.throughput for w in last], [w.avg_latency_s for w in last]):
        mean = sum(values) / 3
        if not mean > 0 or any(abs(v - mean) > mean * pct / 100 for v in values):
            return False
    return True


@dataclass
class Point:
    """The result of one load point: the merge of its last (up to 3) windows. Column order = CSV."""

    protocol: str
    model: str
    batch_size: int
    concurrency: int  # 0 in request-rate mode
    request_rate: float  # offered requests/s; 0 in concurrency mode
    sent_per_s: float
    throughput: float  # inferences/s = requests/s x batch size
    requests: int
    errors: int
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    avg_ms: float
    server_queue_us: float
    server_compute_input_us: float
    server_compute_infer_us: float
    server_compute_output_us: float
    server_batch: float  # requests per execution on the server
    client_cpu_pct: float  # this process's CPU time / wall time (100 = one core)
    late: int  # Poisson arrivals sent over 1 ms after their time (the client could not keep up)
    windows: int
    stable: bool
    seconds: float
    first_error: str = ""

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.columns()}

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.request_rate:g}/s"


def merge(
    windows: Sequence[Window],
    *,
    protocol: str,
    model: str,
    batch_size: int,
    concurrency: int,
    request_rate: float,
    stable_now: bool,
    windows_run: int,
    first_error: str,
) -> Point:
    latencies = [x for w in windows for x in w.latencies_s]
    seconds = sum(w.seconds for w in windows)
    servers = [w.server for w in windows]
    server: Counters | None = None
    if servers and all(s is not None for s in servers):
        server = Counters()
        for s in servers:
            assert s is not None
            server = server + s
    split = server.per_request_us() if server is not None else dict.fromkeys(_SPLIT, math.nan)
    batch = server.success / server.executions if server is not None and server.executions else math.nan

    def ms(q: float) -> float:
        return percentile(latencies, q) * 1e3

    return Point(
        protocol=protocol,
        model=model,
        batch_size=batch_size,
        concurrency=concurrency,
        request_rate=request_rate,
        sent_per_s=sum(w.sent for w in windows) / seconds if seconds else 0.0,
        throughput=len(latencies) * batch_size / seconds if seconds else 0.0,
        requests=len(latencies),
        errors=sum(w.errors for w in windows),
        p50_ms=ms(50),
        p90_ms=ms(90),
        p95_ms=ms(95),
        p99_ms=ms(99),
        max_ms=max(latencies) * 1e3 if latencies else math.nan,
        avg_ms=sum(latencies) / len(latencies) * 1e3 if latencies else math.nan,
        server_queue_us=split["queue"],
        server_compute_input_us=split["compute_input"],
        server_compute_infer_us=split["compute_infer"],
        server_compute_output_us=split["compute_output"],
        server_batch=batch,
        client_cpu_pct=100.0 * sum(w.cpu_s for w in windows) / seconds if seconds else 0.0,
        late=sum(w.late for w in windows),
        windows=windows_run,
        stable=stable_now,
        seconds=seconds,
        first_error=first_error,
    )
