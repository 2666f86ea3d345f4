"""The /metrics page (edgeserve/metrics.py) with the Python models' custom metrics after the built-in
ones: one page that Prometheus' own parser reads, each family once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgeserve import metrics
from edgeserve.custom_metrics import CUSTOM_METRICS


@pytest.fixture
def declared() -> Iterator[None]:
    CUSTOM_METRICS.declare_family("page_test", "page_test_latency_ns", "time spent", "counter")
    CUSTOM_METRICS.apply("page_test", "increment", "page_test_latency_ns", {"model": "m", "version": "1"}, 42)
    CUSTOM_METRICS.declare_family("page_test", "page_test_sizes", "sizes", "histogram", buckets=[1.0, 10.0])
    CUSTOM_METRICS.apply("page_test", "observe", "page_test_sizes", {}, 5)
    yield
    CUSTOM_METRICS.drop_model("page_test")


def test_custom_metrics_are_on_the_page_beside_the_built_in_ones(declared: None) -> None:
    payload, content_type = metrics.render([])
    text = payload.decode()
    assert content_type.startswith("text/plain")
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))  # each family once
    assert {"nv_cpu_utilization", "page_test_latency_ns", "page_test_sizes"} <= set(names)
    assert 'page_test_latency_ns{model="m",version="1"} 42.0\n' in text
    assert 'page_test_sizes_bucket{le="10.0"} 1\n' in text


def test_a_dropped_model_leaves_the_page(declared: None) -> None:
    CUSTOM_METRICS.drop_model("page_test")
    assert "page_test" not in metrics.render([])[0].decode()
