"""The custom metrics registry (edgeserve/custom_metrics.py): Triton's rules, the Prometheus text it
prints (read back with prometheus_client's own parser) and the bounds a hostile model meets."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeserve.custom_metrics import (
    MAX_BUCKETS,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    CustomMetrics,
    CustomMetricsError,
)


def parsed(registry: CustomMetrics) -> dict[str, dict[str, object]]:
    """{family: {"type", "help", "samples": {(sample name, sorted labels): value}}} from the text."""
    out: dict[str, dict[str, object]] = {}
    for family in text_string_to_metric_families(registry.render()):
        # the parser names a counter's samples <name>_total whatever the text says (the text keeps
        # Triton's exact name, as the raw-text asserts check)
        samples = {(_sample(family.type, s.name), tuple(sorted(s.labels.items()))): s.value
                   for s in family.samples}  # fmt: skip
        out[family.name] = {"type": family.type, "help": family.documentation, "samples": samples}
    return out


def _sample(kind: str, name: str) -> str:
    return name.removesuffix("_total") if kind == "counter" else name


def test_counter_prints_as_triton_does_with_the_exact_name_and_labels() -> None:
    registry = CustomMetrics()
    registry.declare_family("custom_metrics", "requests_process_latency_ns",
                            "Cumulative time spent processing requests", "COUNTER")  # fmt: skip
    labels = {"model": "custom_metrics", "version": "1"}
    registry.apply("custom_metrics", "increment", "requests_process_latency_ns", labels, 1500)
    registry.apply("custom_metrics", "increment", "requests_process_latency_ns", labels, 500.5)
    text = registry.render()
    # the lines Triton's own custom_metrics example client looks for
    assert "# HELP requests_process_latency_ns Cumulative time spent processing requests" in text
    assert "# TYPE requests_process_latency_ns counter" in text
    assert 'requests_process_latency_ns{model="custom_metrics",version="1"} 2000.5\n' in text
    assert registry.value("custom_metrics", "requests_process_latency_ns", labels) == 2000.5
    family = parsed(registry)["requests_process_latency_ns"]
    assert family["type"] == "counter"


def test_gauge_set_and_increment_and_a_series_without_labels() -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "queue_depth", "items waiting", "gauge")
    registry.apply("m", "set", "queue_depth", {}, 7)
    registry.apply("m", "increment", "queue_depth", {}, -2)
    registry.apply("m", "set", "queue_depth", {"stage": "pre"}, 1.25)
    samples = parsed(registry)["queue_depth"]["samples"]
    assert samples == {("queue_depth", ()): 5.0, ("queue_depth", (("stage", "pre"),)): 1.25}
    assert registry.value("m", "queue_depth", {"stage": "absent"}) == 0.0


def test_histogram_buckets_sum_and_count_parse() -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "latency_s", "per request", "histogram", buckets=[0.1, 1.0])
    for value in (0.05, 0.5, 0.5, 3.0):
        registry.apply("m", "observe", "latency_s", {"kind": "a"}, value)
    # Triton's Metric(labels, buckets=...): a series may bring its own bounds
    registry.apply("m", "observe", "latency_s", {"kind": "b"}, 2.0, buckets=[1.0, 5.0])
    family = parsed(registry)["latency_s"]
    assert family["type"] == "histogram"
    samples = family["samples"]
    assert isinstance(samples, dict)
    assert samples[("latency_s_bucket", (("kind", "a"), ("le", "0.1")))] == 1
    assert samples[("latency_s_bucket", (("kind", "a"), ("le", "1.0")))] == 3
    assert samples[("latency_s_bucket", (("kind", "a"), ("le", "+Inf")))] == 4
    assert samples[("latency_s_count", (("kind", "a"),))] == 4
    assert math.isclose(float(samples[("latency_s_sum", (("kind", "a"),))]), 4.05)
    assert samples[("latency_s_bucket", (("kind", "b"), ("le", "5.0")))] == 1
    with pytest.raises(CustomMetricsError, match="histogram: value"):
        registry.value("m", "latency_s", {"kind": "a"})


def test_same_name_same_kind_is_one_family_and_another_kind_is_refused() -> None:
    registry = CustomMetrics()
    registry.declare_family("a", "hits", "first description", "counter")
    registry.declare_family("b", "hits", "second description", "counter")  # Triton: the first stays
    registry.apply("a", "increment", "hits", {}, 1)
    registry.apply("b", "increment", "hits", {}, 2)
    family = parsed(registry)["hits"]
    assert family["help"] == "first description"
    assert family["samples"] == {("hits", ()): 3.0}
    with pytest.raises(CustomMetricsError, match="already declared as a counter"):
        registry.declare_family("a", "hits", "x", "gauge")


def test_operations_the_kind_does_not_allow_are_refused() -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "c", "", "counter")
    registry.declare_family("m", "h", "", "histogram", buckets=[1.0])
    with pytest.raises(CustomMetricsError, match="cannot decrease"):
        registry.apply("m", "increment", "c", {}, -1)
    with pytest.raises(CustomMetricsError, match="set is not allowed"):
        registry.apply("m", "set", "c", {}, 1)
    with pytest.raises(CustomMetricsError, match="observe is not allowed"):
        registry.apply("m", "observe", "c", {}, 1)
    with pytest.raises(CustomMetricsError, match="increment is not allowed"):
        registry.apply("m", "increment", "h", {}, 1)
    with pytest.raises(CustomMetricsError, match="buckets are only for histograms"):
        registry.apply("m", "increment", "c", {"x": "1"}, 1, buckets=[1.0])
    with pytest.raises(CustomMetricsError, match="needs buckets"):
        registry.declare_family("m", "h2", "", "histogram")
        registry.apply("m", "observe", "h2", {}, 1)
    with pytest.raises(CustomMetricsError, match="not declared"):
        registry.apply("m", "increment", "nobody", {}, 1)
    with pytest.raises(CustomMetricsError, match="unknown metric operation"):
        registry.apply("m", "reset", "c", {}, 1)
    for value in (math.nan, math.inf, "1", True):
        with pytest.raises(CustomMetricsError, match="must be"):
            registry.apply("m", "increment", "c", {}, value)  # type: ignore[arg-type]
    assert parsed(registry)["c"]["samples"] == {}  # nothing refused left a series behind


@pytest.mark.parametrize(
    ("name", "kind", "buckets", "message"),
    [
        ("has-dash", "counter", None, "not a Prometheus metric name"),
        ("9starts_with_digit", "counter", None, "not a Prometheus metric name"),
        ("x" * 200, "counter", None, "not a Prometheus metric name"),
        ("nv_inference_count", "counter", None, "prefix of the built-in metrics"),
        ("edgeserve_anything", "gauge", None, "prefix of the built-in metrics"),
        ("ok_name", "summary", None, "unknown metric kind"),
        ("ok_name", "gauge", [1.0], "buckets are only for histograms"),
        ("ok_name", "histogram", [2.0, 1.0], "must increase"),
        ("ok_name", "histogram", [float(i) for i in range(MAX_BUCKETS + 1)], "at most"),
        ("ok_name", "histogram", [math.nan], "finite"),
    ],
)
def test_declarations_are_validated(name: str, kind: str, buckets: list[float] | None, message: str) -> None:
    registry = CustomMetrics()
    with pytest.raises(CustomMetricsError, match=message):
        registry.declare_family("m", name, "help", kind, buckets)
    assert registry.render() == ""


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"bad-name": "v"}, "not a Prometheus label name"),
        ({"__reserved": "v"}, "not a Prometheus label name"),
        ({"k": 1}, "string value"),
        ({"k": "v" * (MAX_LABEL_VALUE + 1)}, "string value"),
        ({f"k{i}": "v" for i in range(MAX_LABELS + 1)}, "at most"),
    ],
)
def test_labels_are_validated(labels: dict[str, object], message: str) -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "g", "", "gauge")
    with pytest.raises(CustomMetricsError, match=message):
        registry.apply("m", "set", "g", labels, 1)  # type: ignore[arg-type]
    registry.declare_family("m", "h", "", "histogram", buckets=[1.0])
    with pytest.raises(CustomMetricsError, match="own bucket label"):
        registry.apply("m", "observe", "h", {"le": "1"}, 1)


def test_label_values_and_help_are_escaped_and_still_parse() -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "g", "help with \\ and\nnewline", "gauge")
    registry.apply("m", "set", "g", {"path": 'a"b\\c\nd'}, 1)
    family = parsed(registry)["g"]
    assert family["help"] == "help with \\ and\nnewline"
    assert family["samples"] == {("g", (("path", 'a"b\\c\nd'),)): 1.0}


def test_sample_names_may_not_clash_between_families() -> None:
    registry = CustomMetrics()
    registry.declare_family("m", "lat", "", "histogram", buckets=[1.0])
    with pytest.raises(CustomMetricsError, match="would print samples named like family 'lat'"):
        registry.declare_family("m", "lat_count", "", "counter")


def test_a_hostile_model_cannot_grow_memory_without_bound() -> None:
    registry = CustomMetrics(max_families_per_model=3, max_series_per_model=5, max_series=8)
    for i in range(3):
        registry.declare_family("hostile", f"f{i}", "", "gauge")
    with pytest.raises(CustomMetricsError, match="already declares 3 metric families"):
        registry.declare_family("hostile", "f3", "", "gauge")
    for i in range(5):
        registry.apply("hostile", "set", "f0", {"id": str(i)}, 1)
    with pytest.raises(CustomMetricsError, match="already holds 5 metric series"):
        registry.apply("hostile", "set", "f0", {"id": "5"}, 1)
    registry.apply("hostile", "set", "f0", {"id": "4"}, 2)  # an existing series still updates
    # another model keeps its own allowance, up to the server-wide bound
    registry.declare_family("other", "f0", "", "gauge")
    for i in range(3):
        registry.apply("other", "set", "f0", {"other": str(i)}, 1)
    with pytest.raises(CustomMetricsError, match="8 custom metric series"):
        registry.apply("other", "set", "f0", {"other": "3"}, 1)
    assert len(parsed(registry)["f0"]["samples"]) == 8  # type: ignore[arg-type]


def test_values_survive_until_the_model_is_dropped() -> None:
    """A worker restart declares its families again and finds its values; an unload drops them."""
    registry = CustomMetrics()
    registry.declare_family("m", "hits", "", "counter")
    registry.apply("m", "increment", "hits", {"k": "v"}, 4)
    registry.declare_family("m", "hits", "", "counter")  # the restarted worker's initialize()
    assert registry.value("m", "hits", {"k": "v"}) == 4
    registry.declare_family("n", "shared", "", "gauge")
    registry.declare_family("m", "shared", "", "gauge")
    registry.apply("n", "set", "shared", {}, 1)
    registry.drop_model("m")
    assert set(parsed(registry)) == {"shared"}  # hits went with m; shared stays, declared by n too
    registry.declare_family("m", "hits", "", "gauge")  # the name is free again, any kind
