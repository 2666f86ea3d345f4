"""The ZeroMQ frontend's counters on `/metrics`: how many requests came, how many ran on the
frontend's own thread (inline) and how many were caught while it spun, so the fast path is visible
from outside."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ZmqCounters(Protocol):
    def counters(self) -> dict[str, int]: ...


# name -> (help, counter?) for what `ZmqFrontend.counters()` returns
_METRICS: dict[str, tuple[str, bool]] = {
    "requests": ("ZeroMQ messages received", True),
    "inline_runs": ("Requests run on the ZeroMQ thread itself (no hand-off to a worker)", True),
    "spin_hits": ("Requests that arrived while the ZeroMQ thread spun instead of sleeping", True),
    "dropped_replies": ("Replies dropped because the client was not reading them", True),
    "clients": ("ZeroMQ clients with requests in flight or shared memory registered", False),
    "inflight": ("ZeroMQ requests in flight", False),
}


class ZmqCollector(Collector):
    def __init__(self, frontend: ZmqCounters) -> None:
        self._frontend = frontend

    def collect(self) -> Iterator[Metric]:
        values = self._frontend.counters()
        for key, (help_text, counter) in _METRICS.items():
            name = f"edgeserve_zmq_{key}"
            value = values.get(key, 0)
            if counter:
                yield CounterMetricFamily(name, help_text, value=value)
            else:
                yield GaugeMetricFamily(name, help_text, value=value)
