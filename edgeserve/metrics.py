"""Prometheus text exposition for `/metrics`, with Triton's metric names and labels.

`render(served)` builds a fresh `CollectorRegistry` per scrape (never prometheus_client's global
one) from a collector over the served model versions, the process/system gauges and any collectors
other parts registered with `register_collector` (the registry shared by all parts), then the Python
models' custom metrics (edgeserve/custom_metrics.py, rendered as Triton prints them).

Triton prints its counters without the `_total` suffix (`nv_inference_count`, not
`nv_inference_count_total`) and Grafana dashboards built for Triton query those names, so the
counters here keep Triton's exact sample names and the HELP/TYPE lines are written to match.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from edgeserve.custom_metrics import CUSTOM_METRICS
from edgeserve.scheduling.stats import FAILURE_REASONS, Histogram, ModelStats

log = logging.getLogger("edgeserve.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
_MODEL_LABELS = ("model", "version")

# name -> help text, for the per-model counters Triton exports (name, sample name and TYPE agree).
_COUNTERS: dict[str, str] = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds "
    "(includes cached requests)",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds "
    "(includes cached requests)",
    "nv_inference_compute_input_duration_us": "Cumulative compute input duration in microseconds "
    "(does not include cached requests)",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds "
    "(does not include cached requests)",
    "nv_inference_compute_output_duration_us": "Cumulative inference compute output duration in "
    "microseconds (does not include cached requests)",
    "nv_cache_num_hits_per_model": "Number of cache hits per model",
    "nv_cache_num_misses_per_model": "Number of cache misses per model",
    "nv_cache_hit_duration_per_model": "Total cache hit duration per model, in microseconds",
    "nv_cache_miss_duration_per_model": "Total cache miss (lookup + insertion) duration per model, in "
    "microseconds",
}
_HEADER_FIX = re.compile(rb"^# (HELP|TYPE) (" + b"|".join(n.encode() for n in _COUNTERS) + rb")_total ", re.M)

_extra: list[Collector] = []
_extra_lock = threading.Lock()
_process: Any = None  # psutil.Process, created on first scrape (cpu_percent needs the same object)


def register_collector(collector: Collector) -> None:
    """Add a collector (e.g. the fleet agent's or the shm registry's) to every later scrape."""
    with _extra_lock:
        if collector not in _extra:
            _extra.append(collector)


def unregister_collector(collector: Collector) -> None:
    with _extra_lock:
        if collector in _extra:
            _extra.remove(collector)


def render(served: Iterable[object]) -> tuple[bytes, str]:
    """(Prometheus text, content type) for the given served model versions; each has `.name`,
    `.version`, `.stats` (ModelStats) and `.scheduler.pending_count`."""
    registry = CollectorRegistry(auto_describe=False)
    models = list(served)
    registry.register(ModelCollector(models))
    registry.register(SystemCollector())
    registry.register(MemoryCollector(models))
    with _extra_lock:
        extra = list(_extra)
    for collector in extra:
        registry.register(collector)
    builtin = _HEADER_FIX.sub(rb"# \1 \2 ", generate_latest(registry))
    # the custom families' names never collide with these (custom_metrics.RESERVED_PREFIXES)
    return builtin + CUSTOM_METRICS.render().encode(), CONTENT_TYPE


def _counter(name: str) -> Metric:
    return Metric(name, _COUNTERS[name], "counter")


class ModelCollector(Collector):
    """Per model version: Triton's nv_inference_* counters and gauge, plus edgeserve histograms."""

    def __init__(self, served: list[object]) -> None:
        self._served = served

    def collect(self) -> Iterator[Metric]:
        counters = {name: _counter(name) for name in _COUNTERS}
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting execution per-model.",
                                    labels=_MODEL_LABELS)  # fmt: skip
        sequences = GaugeMetricFamily("edgeserve_sequence_active", "Sequences holding a batch slot",
                                      labels=_MODEL_LABELS)  # fmt: skip
        backlog = GaugeMetricFamily("edgeserve_sequence_backlog", "Sequences waiting for a batch slot",
                                    labels=_MODEL_LABELS)  # fmt: skip
        inline = CounterMetricFamily("edgeserve_inline_runs",
                                     "Requests a frontend ran itself (its thread or event loop), with no "
                                     "hand-off to a worker", labels=_MODEL_LABELS)  # fmt: skip
        histograms = {
            "request": HistogramMetricFamily("edgeserve_request_duration_seconds",
                                             "Latency of successful requests, arrival to response ready",
                                             labels=_MODEL_LABELS),
            "queue": HistogramMetricFamily("edgeserve_queue_duration_seconds",
                                           "Time successful requests spent queued before their batch started",
                                           labels=_MODEL_LABELS),
            "infer": HistogramMetricFamily("edgeserve_compute_infer_duration_seconds",
                                           "Backend execution time per executed batch", labels=_MODEL_LABELS),
        }  # fmt: skip
        for item in self._served:
            stats: ModelStats | None = getattr(item, "stats", None)
            if stats is None:
                continue
            labels = {"model": str(getattr(item, "name", stats.name)),
                      "version": str(getattr(item, "version", stats.version))}  # fmt: skip
            snap = stats.snapshot()
            values = {
                "nv_inference_request_success": snap.success.count,
                "nv_inference_count": snap.inference_count,
                "nv_inference_exec_count": snap.execution_count,
                "nv_inference_request_duration_us": snap.success.ns // 1000,
                "nv_inference_queue_duration_us": snap.queue.ns // 1000,
                "nv_inference_compute_input_duration_us": snap.compute_input.ns // 1000,
                "nv_inference_compute_infer_duration_us": snap.compute_infer.ns // 1000,
                "nv_inference_compute_output_duration_us": snap.compute_output.ns // 1000,
                "nv_cache_num_hits_per_model": snap.cache_hit.count,
                "nv_cache_num_misses_per_model": snap.cache_miss.count,
                "nv_cache_hit_duration_per_model": snap.cache_hit.ns // 1000,
                "nv_cache_miss_duration_per_model": snap.cache_miss.ns // 1000,
            }
            for name, value in values.items():
                counters[name].add_sample(name, labels, value)
            fail = "nv_inference_request_failure"
            for reason in FAILURE_REASONS:
                counters[fail].add_sample(fail, {**labels, "reason": reason}, snap.fail_by_reason[reason])
            scheduler = getattr(item, "scheduler", None)
            pending.add_metric([labels["model"], labels["version"]], getattr(scheduler, "pending_count", 0))
            inline.add_metric([labels["model"], labels["version"]], getattr(scheduler, "inline_runs", 0))
            if scheduler is not None and hasattr(scheduler, "active_sequences"):  # a sequence batcher
                sequences.add_metric([labels["model"], labels["version"]], scheduler.active_sequences)
                backlog.add_metric([labels["model"], labels["version"]], scheduler.backlog)
            for key, hist in (("request", snap.request_hist), ("queue", snap.queue_hist),
                              ("infer", snap.compute_infer_hist)):  # fmt: skip
                _add_histogram(histograms[key], [labels["model"], labels["version"]], hist)
        yield from counters.values()
        yield pending
        yield sequences
        yield backlog
        yield inline
        yield from histograms.values()


def _add_histogram(family: HistogramMetricFamily, labels: list[str], hist: Histogram) -> None:
    buckets = [(floatToGoString(bound), float(count)) for bound, count in hist.cumulative()]  # type: ignore[no-untyped-call]
    family.add_metric(labels, buckets, hist.sum_ns / 1e9)


class SystemCollector(Collector):
    """Triton's nv_cpu_* gauges (whole system) and this process's resident memory, via psutil."""

    def collect(self) -> Iterator[Metric]:
        global _process
        try:
            import psutil

            if _process is None:
                _process = psutil.Process()
                _process.cpu_percent(None)
            cpu = psutil.cpu_percent(None) / 100.0
            memory = psutil.virtual_memory()
            rss = _process.memory_info().rss
            threads = _process.num_threads()
        except Exception as exc:  # psutil missing or /proc unreadable: skip these, keep the scrape
            log.debug("system metrics unavailable: %s", exc)
            return
        yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=cpu)
        yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes",
                                value=memory.total)  # fmt: skip
        yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes",
                                value=memory.total - memory.available)  # fmt: skip
        yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.", value=rss)
        yield GaugeMetricFamily("process_num_threads", "Number of OS threads in the process.", value=threads)


class MemoryCollector(Collector):
    """The memory breakdown (edgeserve/procmem.py says what each figure means):
    edgeserve_process_memory_bytes{process, pid, name, models, kind} for the server, its supervisor and
    each Python worker; edgeserve_appliance_memory_bytes{kind} their sum (the issue's target is on the
    rss sum; pss counts shared pages once); edgeserve_model_memory_estimate_bytes{model, version, kind}
    per served model version."""

    def __init__(self, served: list[object]) -> None:
        self._served = served

    def collect(self) -> Iterator[Metric]:
        from edgeserve import procmem

        try:
            processes = procmem.processes()
        except Exception as exc:  # psutil missing or /proc unreadable: skip these, keep the scrape
            log.debug("memory breakdown unavailable: %s", exc)
            return
        labels = ["process", "pid", "name", "models", "kind"]
        family = GaugeMetricFamily(
            "edgeserve_process_memory_bytes",
            "Memory of each appliance process (kind: rss, pss, uss)",
            labels=labels,
        )
        totals = GaugeMetricFamily(
            "edgeserve_appliance_memory_bytes",
            "Memory of the appliance processes together (rss counts shared pages once per process, pss once)",
            labels=["kind"],
        )
        for process in processes:
            names = [process.role, str(process.pid), process.name, ",".join(process.models)]
            for kind in procmem.KINDS:
                family.add_metric([*names, kind], float(getattr(process, kind)))
        for kind in procmem.KINDS:
            totals.add_metric([kind], float(sum(getattr(p, kind) for p in processes)))
        yield family
        yield totals
        workers = {p.pid: p for p in processes if p.role == procmem.PYTHON_WORKER}
        per_model = GaugeMetricFamily("edgeserve_model_memory_estimate_bytes", "What a model version's "
                                      "backend holds (kind: weights; worker_rss/pss/uss for Python models: "
                                      "their worker process, shared by a worker group's models)",
                                      labels=["model", "version", "kind"])  # fmt: skip
        for item in self._served:
            estimates = procmem.model_estimates(getattr(item, "instances", ()) or (), workers)
            labels = [str(getattr(item, "name", "")), str(getattr(item, "version", ""))]
            for kind, value in sorted(estimates.items()):
                per_model.add_metric([*labels, kind], float(value))
        yield per_model
