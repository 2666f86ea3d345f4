"""Per-model-version statistics: Triton's ModelStatistics (HTTP/gRPC stats) plus latency histograms
for Prometheus. One lock per model; every recording call takes it once.

Durations are monotonic nanoseconds; only `last_inference` uses the wall clock (ms since epoch), as
Triton does. Counting follows Triton: `success`/`queue`/compute_* count requests (a request in a
batch of 8 is counted once, with the whole batch's compute time), `inference_count` counts batch
rows and `execution_count` batches; `batch_stats` has one entry per executed batch size.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the latency histograms: 50 µs .. 10 s, roughly 1-2.5-5 per decade.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_BUCKETS_NS: tuple[int, ...] = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)

# The `reason` label Triton puts on nv_inference_request_failure.
FAILURE_REASONS: tuple[str, ...] = ("REJECTED", "CANCELED", "BACKEND", "OTHER")

MAX_RESPONSE_KEYS = 64  # response_stats keys kept per model (decoupled streams)
_INFERENCE_STATS_KEYS = (
    "success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss",
)  # fmt: skip


@dataclass(slots=True)
class Duration:
    """A Triton StatisticDuration: how many, and their summed nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        if ns > 0:  # a branch, not max(): this runs ~10 times per request
            self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class Histogram:
    """Fixed-bucket latency histogram; `counts[i]` holds observations in bucket i (not cumulative),
    the last slot is the +Inf overflow."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(_BUCKETS_NS) + 1))
    sum_ns: int = 0

    def observe(self, ns: int) -> None:
        if ns < 0:
            ns = 0
        self.counts[bisect.bisect_left(_BUCKETS_NS, ns)] += 1
        self.sum_ns += ns

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound in s, cumulative count)] ending with (+inf, total), Prometheus style."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(list(self.counts), self.sum_ns)


@dataclass(slots=True)
class _BatchStat:
    count: int = 0
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(frozen=True, slots=True)
class JobTiming:
    """One successful request of an executed batch."""

    request_ns: int  # arrival -> response handed to its callback
    queue_ns: int  # enqueue -> batch taken by a worker
    compute_output_ns: int  # split + callback dispatch up to this request


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """A consistent copy of the counters Prometheus needs (taken under the lock)."""

    success: Duration
    fail: Duration
    fail_by_reason: dict[str, int]
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration
    inference_count: int
    execution_count: int
    last_inference_ms: int
    request_hist: Histogram
    queue_hist: Histogram
    compute_infer_hist: Histogram


class ModelStats:
    """Statistics of one model version; all methods are thread-safe."""

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = int(version)
        self._lock = threading.Lock()
        self._stats: dict[str, Duration] = {key: Duration() for key in _INFERENCE_STATS_KEYS}
        self._fail_by_reason: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self._batches: dict[int, _BatchStat] = {}
        self._inference_count = 0
        self._execution_count = 0
        self._last_inference_ms = 0
        self._request_hist = Histogram()
        self._queue_hist = Histogram()
        self._compute_infer_hist = Histogram()
        self._responses: dict[int, list[int]] = {}  # decoupled: response index -> [success, fail]

    # -- recording ------------------------------------------------------------------------------
    def record_success(self, request_ns: int, queue_ns: int, compute_input_ns: int, compute_infer_ns: int,
                       compute_output_ns: int) -> None:  # fmt: skip
        """One request that got its response (its batch is recorded by `record_batch`)."""
        with self._lock:
            self._success_locked(request_ns, queue_ns, compute_input_ns, compute_infer_ns, compute_output_ns)

    def record_fail(self, duration_ns: int, reason: str = "OTHER") -> None:
        """One request that ended in an error; `reason` is one of FAILURE_REASONS."""
        with self._lock:
            self._stats["fail"].add(duration_ns)
            key = reason if reason in self._fail_by_reason else "OTHER"
            self._fail_by_reason[key] += 1

    def record_cache_hit(self, request_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache: counted in success and queue (as Triton does),
        not in inference/execution counts."""
        with self._lock:
            self._stats["success"].add(request_ns)
            self._stats["queue"].add(max(0, request_ns - lookup_ns))
            self._stats["cache_hit"].add(lookup_ns)
            self._request_hist.observe(request_ns)
            self._last_inference_ms = time.time_ns() // 1_000_000

    def record_response(self, index: int, failed: bool) -> None:
        """One response of a decoupled request (its `index`-th); indexes past MAX_RESPONSE_KEYS - 1
        share the last key, so a long stream cannot grow the statistics."""
        key = min(index, MAX_RESPONSE_KEYS - 1)
        with self._lock:
            counts = self._responses.get(key)
            if counts is None:
                counts = self._responses[key] = [0, 0]
            counts[1 if failed else 0] += 1

    def record_cache_miss(self, lookup_ns: int) -> None:
        """A cacheable request that ran the model: lookup + insertion time."""
        with self._lock:
            self._stats["cache_miss"].add(lookup_ns)

    def record_batch(self, batch_size: int, compute_input_ns: int, compute_infer_ns: int,
                     compute_output_ns: int) -> None:  # fmt: skip
        """One executed batch of `batch_size` rows."""
        with self._lock:
            self._batch_locked(batch_size, compute_input_ns, compute_infer_ns, compute_output_ns)

    def record_execution(self, batch_size: int, compute_input_ns: int, compute_infer_ns: int,
                         compute_output_ns: int, jobs: Iterable[JobTiming]) -> None:  # fmt: skip
        """A batch and all of its successful requests, under one lock acquisition."""
        with self._lock:
            self._batch_locked(batch_size, compute_input_ns, compute_infer_ns, compute_output_ns)
            for job in jobs:
                self._success_locked(job.request_ns, job.queue_ns, compute_input_ns, compute_infer_ns,
                                     job.compute_output_ns)  # fmt: skip

    def _success_locked(self, request_ns: int, queue_ns: int, compute_input_ns: int, compute_infer_ns: int,
                        compute_output_ns: int) -> None:  # fmt: skip
        stats = self._stats
        stats["success"].add(request_ns)
        stats["queue"].add(queue_ns)
        stats["compute_input"].add(compute_input_ns)
        stats["compute_infer"].add(compute_infer_ns)
        stats["compute_output"].add(compute_output_ns)
        self._request_hist.observe(request_ns)
        self._queue_hist.observe(queue_ns)

    def _batch_locked(self, batch_size: int, compute_input_ns: int, compute_infer_ns: int,
                      compute_output_ns: int) -> None:  # fmt: skip
        entry = self._batches.get(batch_size)
        if entry is None:
            entry = self._batches[batch_size] = _BatchStat()
        entry.count += 1
        entry.compute_input.add(compute_input_ns)
        entry.compute_infer.add(compute_infer_ns)
        entry.compute_output.add(compute_output_ns)
        self._inference_count += batch_size
        self._execution_count += 1
        self._last_inference_ms = time.time_ns() // 1_000_000
        self._compute_infer_hist.observe(compute_infer_ns)

    # -- reading --------------------------------------------------------------------------------
    @property
    def inference_count(self) -> int:
        return self._inference_count

    @property
    def execution_count(self) -> int:
        return self._execution_count

    def to_dict(self) -> dict[str, Any]:
        """Triton's HTTP JSON for one entry of `model_stats` (version as a string)."""
        with self._lock:
            batch_stats: list[dict[str, Any]] = []
            for size in sorted(self._batches):
                entry = self._batches[size]
                batch_stats.append({
                    "batch_size": size,
                    "compute_input": {"count": entry.count, "ns": entry.compute_input.ns},
                    "compute_infer": {"count": entry.count, "ns": entry.compute_infer.ns},
                    "compute_output": {"count": entry.count, "ns": entry.compute_output.ns},
                })  # fmt: skip
            return {
                "name": self.name,
                "version": str(self.version),
                "last_inference": self._last_inference_ms,
                "inference_count": self._inference_count,
                "execution_count": self._execution_count,
                "inference_stats": {key: self._stats[key].as_dict() for key in _INFERENCE_STATS_KEYS},
                "batch_stats": batch_stats,
                "memory_usage": [],
                "response_stats": {
                    str(key): {"success": {"count": ok, "ns": 0}, "fail": {"count": failed, "ns": 0}}
                    for key, (ok, failed) in sorted(self._responses.items())
                },
            }

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            s = self._stats

            def dup(key: str) -> Duration:
                return Duration(s[key].count, s[key].ns)

            return StatsSnapshot(
                success=dup("success"),
                fail=dup("fail"),
                fail_by_reason=dict(self._fail_by_reason),
                queue=dup("queue"),
                compute_input=dup("compute_input"),
                compute_infer=dup("compute_infer"),
                compute_output=dup("compute_output"),
                cache_hit=dup("cache_hit"),
                cache_miss=dup("cache_miss"),
                inference_count=self._inference_count,
                execution_count=self._execution_count,
                last_inference_ms=self._last_inference_ms,
                request_hist=self._request_hist.copy(),
                queue_hist=self._queue_hist.copy(),
                compute_infer_hist=self._compute_infer_hist.copy(),
            )


def batch_sizes(stats_dict: dict[str, Any]) -> dict[int, int]:
    """{batch_size: executions} from a `to_dict()` result (handy for tests and `bench`)."""
    entries: Sequence[dict[str, Any]] = stats_dict["batch_stats"]
    return {int(e["batch_size"]): int(e["compute_infer"]["count"]) for e in entries}
