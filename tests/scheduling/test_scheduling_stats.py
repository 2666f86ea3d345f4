"""ModelStats (Triton's statistics JSON) and the Prometheus exposition in edgeserve.metrics."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families
from sched_helpers import WAIT_S, hold_worker, make_job, mlp_input, submit_all

from edgeserve import metrics
from edgeserve.scheduling.stats import LATENCY_BUCKETS_S, Histogram, JobTiming, ModelStats

DURATION_KEYS = {"count", "ns"}
BATCHING_8 = "max_batch_size: 8\ndynamic_batching { }\n"


def test_to_dict_has_tritons_shape():
    stats = ModelStats("mlp", 3)
    pair = [JobTiming(90_000, 10_000, 1_500), JobTiming(80_000, 5_000, 2_000)]
    stats.record_execution(2, 1_000, 50_000, 2_000, pair)
    stats.record_execution(1, 500, 20_000, 700, [JobTiming(30_000, 1_000, 700)])
    stats.record_fail(4_000)
    data = stats.to_dict()
    assert set(data) == {"name", "version", "last_inference", "inference_count", "execution_count",
                         "inference_stats", "batch_stats", "memory_usage", "response_stats"}  # fmt: skip
    assert data["name"] == "mlp"
    assert data["version"] == "3"
    assert isinstance(data["last_inference"], int) and data["last_inference"] > 1_600_000_000_000  # ms epoch
    assert (data["inference_count"], data["execution_count"]) == (3, 2)
    inference = data["inference_stats"]
    assert set(inference) == {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                              "cache_hit", "cache_miss"}  # fmt: skip
    assert all(set(value) == DURATION_KEYS for value in inference.values())
    assert inference["success"] == {"count": 3, "ns": 200_000}
    assert inference["fail"] == {"count": 1, "ns": 4_000}
    assert inference["queue"] == {"count": 3, "ns": 16_000}
    # each request carries its whole batch's compute time, as in Triton
    assert inference["compute_infer"] == {"count": 3, "ns": 120_000}
    assert inference["compute_input"] == {"count": 3, "ns": 2_500}
    assert inference["compute_output"] == {"count": 3, "ns": 4_200}
    assert inference["cache_hit"] == inference["cache_miss"] == {"count": 0, "ns": 0}
    assert data["batch_stats"] == [
        {"batch_size": 1, "compute_input": {"count": 1, "ns": 500},
         "compute_infer": {"count": 1, "ns": 20_000}, "compute_output": {"count": 1, "ns": 700}},
        {"batch_size": 2, "compute_input": {"count": 1, "ns": 1_000},
         "compute_infer": {"count": 1, "ns": 50_000}, "compute_output": {"count": 1, "ns": 2_000}},
    ]  # fmt: skip
    assert data["memory_usage"] == []
    assert data["response_stats"] == {}


def test_fresh_stats_are_zero():
    data = ModelStats("m", 1).to_dict()
    assert data["last_inference"] == 0
    assert data["batch_stats"] == []
    assert all(v == {"count": 0, "ns": 0} for v in data["inference_stats"].values())


def test_histogram_buckets_are_inclusive_upper_bounds():
    hist = Histogram()
    for ns in (0, 50_000, 50_001, 10_000_000_000, 20_000_000_000):
        hist.observe(ns)
    cumulative = dict(hist.cumulative())
    assert cumulative[LATENCY_BUCKETS_S[0]] == 2  # 0 and exactly 50 µs
    assert cumulative[0.0001] == 3
    assert cumulative[10.0] == 4
    assert cumulative[float("inf")] == 5 == hist.count
    assert hist.sum_ns == 30_000_100_001


def test_recording_from_many_threads_loses_nothing():
    stats = ModelStats("m", 1)

    def work() -> None:
        for _ in range(500):
            stats.record_execution(2, 1, 1, 1, [JobTiming(1, 1, 1)] * 2)
            stats.record_fail(1, "BACKEND")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    data = stats.to_dict()
    assert data["inference_count"] == 8 * 500 * 2
    assert data["execution_count"] == 8 * 500
    assert data["inference_stats"]["success"]["count"] == 8 * 500 * 2
    assert data["inference_stats"]["fail"]["count"] == 8 * 500
    assert stats.snapshot().request_hist.count == 8 * 500 * 2


def _families(body: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} from Prometheus text."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_render_reports_a_real_schedulers_numbers(make_scheduler):
    scheduler, (instance,) = make_scheduler("mlp", BATCHING_8, open_gate=False)
    first, first_result = hold_worker(scheduler, instance, mlp_input())
    jobs = submit_all(scheduler, [mlp_input(seed=i) for i in range(3)])
    served = SimpleNamespace(name="mlp", version=1, stats=scheduler.stats, scheduler=scheduler)
    body, content_type = metrics.render([served])
    assert content_type.startswith("text/plain")
    pending = _families(body)["nv_inference_pending_request_count"]
    assert pending[(("model", "mlp"), ("version", "1"))] == 3
    instance.gate.set()
    for _, result in [(first, first_result), *jobs]:
        result.outputs()
    assert scheduler.wait_idle(WAIT_S)
    scheduler.submit(make_job(mlp_input(), timeout_us=1, age_s=1.0)[0])  # rejected: timeout expired
    assert scheduler.wait_idle(WAIT_S)

    body, _ = metrics.render([served])
    text = body.decode()
    assert "# TYPE nv_inference_count counter\n" in text  # Triton's names: no _total suffix
    assert '\nnv_inference_count{model="mlp",version="1"} 4.0\n' in text
    samples = _families(body)
    key = (("model", "mlp"), ("version", "1"))
    # the parser normalises counter sample names to *_total
    assert samples["nv_inference_request_success_total"][key] == 4
    assert samples["nv_inference_count_total"][key] == 4
    assert samples["nv_inference_exec_count_total"][key] == 2
    assert samples["nv_inference_pending_request_count"][key] == 0
    failures = samples["nv_inference_request_failure_total"]
    assert failures[(("model", "mlp"), ("reason", "REJECTED"), ("version", "1"))] == 1
    assert failures[(("model", "mlp"), ("reason", "BACKEND"), ("version", "1"))] == 0
    snap = scheduler.stats.snapshot()
    durations = {"request": snap.success, "queue": snap.queue, "compute_input": snap.compute_input,
                 "compute_infer": snap.compute_infer, "compute_output": snap.compute_output}  # fmt: skip
    for name, duration in durations.items():
        assert samples[f"nv_inference_{name}_duration_us_total"][key] == duration.ns // 1000
    assert samples["nv_inference_request_duration_us_total"][key] > 0
    assert samples["edgeserve_request_duration_seconds_count"][key] == 4
    assert samples["edgeserve_queue_duration_seconds_count"][key] == 4
    assert samples["edgeserve_compute_infer_duration_seconds_count"][key] == 2
    buckets = samples["edgeserve_request_duration_seconds_bucket"]
    assert buckets[(("le", "+Inf"), ("model", "mlp"), ("version", "1"))] == 4
    assert len(buckets) == len(LATENCY_BUCKETS_S) + 1
    assert 0.0 <= samples["nv_cpu_utilization"][()] <= 1.0
    assert samples["process_resident_memory_bytes"][()] > 0
    assert samples["nv_cpu_memory_total_bytes"][()] > 0


def test_metrics_render_with_no_models_and_extra_collectors():
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    class Extra(Collector):
        def collect(self):
            yield GaugeMetricFamily("edgeserve_test_extra", "an extra collector", value=7)

    extra = Extra()
    metrics.register_collector(extra)
    try:
        body, _ = metrics.render([])
    finally:
        metrics.unregister_collector(extra)
    samples = _families(body)
    assert samples["edgeserve_test_extra"][()] == 7
    assert "nv_inference_count_total" not in samples  # no models: no per-model samples
    assert "edgeserve_test_extra" not in _families(metrics.render([])[0])
