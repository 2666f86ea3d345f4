"""pb_utils.MetricFamily / Metric inside the worker (Triton's custom metrics API).

The values live in the server (edgeserve/custom_metrics.py), so they survive a worker restart and show
on /metrics: a declaration and `value()` ask the server over the event channel (an error comes back as
TritonModelException), an update is posted without waiting (the worker checks what it can first: the
operation fits the kind, a counter never decreases; the server logs anything else it refuses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from edgeserve.backends.python import pb_bls
from edgeserve.backends.python.channel import ChannelClosed
from edgeserve.backends.python.pb_core import TritonModelException


def _ask(link: pb_bls.Link, message: dict[str, Any]) -> dict[str, Any]:
    try:
        answer = link.channel.call(message)
    except ChannelClosed:
        raise TritonModelException("the server went away") from None
    if "error" in answer:
        raise TritonModelException(str(answer["error"]))
    return answer


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name: str, description: str, kind: str) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(f"MetricFamily kind must be COUNTER, GAUGE or HISTOGRAM, not {kind!r}")
        self._link = pb_bls._link()
        self.name = str(name)
        self.kind = kind
        _ask(self._link, {"op": "family", "name": self.name, "description": str(description),
                          "kind": kind.lower()})  # fmt: skip

    def Metric(  # Triton's name
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        return Metric(self, dict(labels or {}), buckets)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: Sequence[float] | None) -> None:
        if family.kind == MetricFamily.HISTOGRAM and buckets is None:
            raise TritonModelException("a HISTOGRAM metric needs buckets")
        if family.kind != MetricFamily.HISTOGRAM and buckets is not None:
            raise TritonModelException(f"buckets are for a HISTOGRAM metric, not a {family.kind}")
        self._family = family
        self._labels = {str(k): str(v) for k, v in labels.items()}
        self._buckets = [float(b) for b in buckets] if buckets is not None else None
        _ask(family._link, {"op": "series", "family": family.name, "labels": self._labels,
                            "buckets": self._buckets})  # fmt: skip

    def _post(self, op: str, value: float) -> None:
        allowed = {"COUNTER": ("increment",), "GAUGE": ("increment", "set"), "HISTOGRAM": ("observe",)}
        if op not in allowed[self._family.kind]:
            raise TritonModelException(f"{op}() is not supported for a {self._family.kind} metric")
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a COUNTER metric cannot be incremented by a negative value")
        try:
            self._family._link.channel.post({"op": "metric", "do": op, "family": self._family.name,
                                             "labels": self._labels, "value": float(value),
                                             "buckets": self._buckets})  # fmt: skip
        except ChannelClosed:
            raise TritonModelException("the server went away") from None

    def increment(self, value: float) -> None:
        self._post("increment", value)

    def set(self, value: float) -> None:
        self._post("set", value)

    def observe(self, value: float) -> None:
        self._post("observe", value)

    def value(self) -> float:
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("value() is not supported for a HISTOGRAM metric")
        message = {"op": "value", "family": self._family.name, "labels": self._labels}
        answer = _ask(self._family._link, message)
        return float(answer.get("value", 0.0))
