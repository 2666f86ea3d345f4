"""Custom metrics of Python models (Triton's `pb_utils.MetricFamily` / `Metric`), held by the server.

The worker's `pb_utils` objects send their declarations and updates to the server-side Python instance,
which calls `CUSTOM_METRICS` here; `/metrics` (the HTTP port and the `[metrics]` port) renders them after
the built-in metrics. They live in the server, so a worker that crashes and restarts finds its families
and values as it left them (Triton keeps them in the server process too).

Triton's rules: a family is named server-wide; declaring a name again with the same kind is the same
family (the first description stays), with another kind an error. Samples keep the family's exact name
(a counter has no `_total` suffix) and exactly the labels the model gave, as Triton prints them.

A model is untrusted code as far as memory goes: names, labels, label values, descriptions and buckets
are validated and bounded, and each model may hold at most MAX_FAMILIES_PER_MODEL families and
MAX_SERIES_PER_MODEL series (label sets), all models together MAX_SERIES; beyond, the call fails with
CustomMetricsError and nothing is added.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

KINDS = ("counter", "gauge", "histogram")
OPS = ("increment", "set", "observe")
MAX_FAMILIES_PER_MODEL = 64
MAX_SERIES_PER_MODEL = 1024
MAX_SERIES = 16384  # all models together
MAX_LABELS = 16  # label pairs of one series
MAX_BUCKETS = 64
MAX_NAME = 128  # a family or label name
MAX_LABEL_VALUE = 256
MAX_DESCRIPTION = 1024
# The built-in families use these prefixes (edgeserve/metrics.py and the collectors it renders); a custom
# family there could repeat a built-in name, and a page with a family twice is refused by Prometheus.
RESERVED_PREFIXES = ("nv_", "edgeserve_", "process_", "python_", "__")
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

LabelKey = tuple[tuple[str, str], ...]


class CustomMetricsError(ValueError):
    """A refused declaration or update; the message says what and why (the model sees it)."""


@dataclass
class _Series:
    owner: str  # the model that created it (its caps count it)
    value: float = 0.0  # counter and gauge
    buckets: tuple[float, ...] = ()  # histogram: upper bounds, +Inf implied
    counts: list[int] = field(default_factory=list)  # histogram: per bucket (not cumulative), +Inf last
    total: float = 0.0  # histogram sum


@dataclass
class _Family:
    name: str
    description: str
    kind: str
    buckets: tuple[float, ...] | None
    declared_by: set[str] = field(default_factory=set)
    series: dict[LabelKey, _Series] = field(default_factory=dict)


class CustomMetrics:
    """The server-wide registry of custom metric families; thread-safe (instances update it from their
    threads while the event loop renders it)."""

    def __init__(
        self,
        max_families_per_model: int = MAX_FAMILIES_PER_MODEL,
        max_series_per_model: int = MAX_SERIES_PER_MODEL,
        max_series: int = MAX_SERIES,
    ) -> None:
        self.max_families_per_model = max_families_per_model
        self.max_series_per_model = max_series_per_model
        self.max_series = max_series
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._sample_names: dict[str, str] = {}  # every sample name a family prints -> the family
        self._series_of: dict[str, int] = {}  # model -> series it created

    def declare_family(
        self, model: str, name: str, description: str, kind: str, buckets: Sequence[float] | None = None
    ) -> None:
        """Triton's `MetricFamily(name, description, kind)`: the same name and kind again is the same
        family. `buckets`: a histogram's default bounds for series that bring none."""
        kind = _kind(kind)
        _check_name(name)
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
            raise CustomMetricsError(
                f"metric family {name!r}: the description must be a string of at most "
                f"{MAX_DESCRIPTION} characters"
            )
        bounds = _buckets(name, kind, buckets) if buckets is not None else None
        with self._lock:
            family = self._families.get(name)
            if family is not None:
                if family.kind != kind:
                    raise CustomMetricsError(
                        f"metric family {name!r} is already declared as a {family.kind}, "
                        f"not a {kind} (a name has one kind)"
                    )
                if model not in family.declared_by:
                    self._check_family_cap(model)
                    family.declared_by.add(model)
                if family.buckets is None and bounds is not None:
                    family.buckets = bounds
                return
            names = _sample_names(name, kind)
            clash = next((self._sample_names[n] for n in names if n in self._sample_names), None)
            if clash is not None:
                raise CustomMetricsError(
                    f"metric family {name!r} would print samples named like family "
                    f"{clash!r}; choose another name"
                )
            self._check_family_cap(model)
            self._families[name] = _Family(name, description, kind, bounds, {model})
            for sample in names:
                self._sample_names[sample] = name

    def apply(
        self,
        model: str,
        op: str,
        family: str,
        labels: Mapping[str, str],
        value: float,
        buckets: Sequence[float] | None = None,
    ) -> None:
        """`Metric(labels).increment/set/observe(value)`: the series is created on first use (`buckets`
        for a histogram's: Triton's `Metric(labels, buckets=[...])`, else the family's)."""
        if op not in OPS:
            raise CustomMetricsError(f"unknown metric operation {op!r}; use one of {', '.join(OPS)}")
        number = _finite(family, value)
        with self._lock:
            fam = self._family(family)
            allowed = {"counter": "increment", "gauge": "increment or set", "histogram": "observe"}[fam.kind]
            if op not in allowed.split(" or "):
                raise CustomMetricsError(
                    f"metric family {family!r} is a {fam.kind}: {op} is not allowed (only {allowed})"
                )
            if fam.kind == "counter" and number < 0:
                raise CustomMetricsError(
                    f"metric family {family!r} is a counter: it cannot decrease (increment by {value})"
                )
            series = self._series(model, fam, labels, buckets)
            if op == "increment":
                series.value += number
            elif op == "set":
                series.value = number
            else:
                series.counts[_bucket_index(series.buckets, number)] += 1
                series.total += number

    def declare_series(
        self, model: str, family: str, labels: Mapping[str, str], buckets: Sequence[float] | None = None
    ) -> None:
        """Triton's `family.Metric(labels, buckets)` before any update: the series shows as 0 at once."""
        with self._lock:
            self._series(model, self._family(family), labels, buckets)

    def value(self, model: str, family: str, labels: Mapping[str, str]) -> float:
        """`Metric.value()`: a counter's or gauge's value (0 for a series never updated)."""
        key = _label_key(family, labels)
        with self._lock:
            fam = self._family(family)
            if fam.kind == "histogram":
                raise CustomMetricsError(
                    f"metric family {family!r} is a histogram: value() is not supported (as in Triton)"
                )
            series = fam.series.get(key)
            return series.value if series is not None else 0.0

    def drop_model(self, model: str) -> None:
        """The model is unloaded (not a worker restart): its series go, and the families only it declared."""
        with self._lock:
            for name, fam in list(self._families.items()):
                fam.series = {k: s for k, s in fam.series.items() if s.owner != model}
                fam.declared_by.discard(model)
                if not fam.declared_by and not fam.series:
                    del self._families[name]
                    for sample in _sample_names(name, fam.kind):
                        self._sample_names.pop(sample, None)
            self._series_of.pop(model, None)

    def clear(self) -> None:
        with self._lock:
            self._families.clear()
            self._sample_names.clear()
            self._series_of.clear()

    def render(self) -> str:
        """The families in Prometheus text format 0.0.4, as Triton prints them."""
        with self._lock:
            families = [
                (f.name, f.description, f.kind, [(k, _copy(s)) for k, s in f.series.items()])
                for f in self._families.values()
            ]
        lines: list[str] = []
        for name, description, kind, series in families:
            lines.append(f"# HELP {name} {_escape_help(description)}")
            lines.append(f"# TYPE {name} {kind}")
            for key, item in series:
                if kind != "histogram":
                    lines.append(f"{name}{_labels(key)} {floatToGoString(item.value)}")  # type: ignore[no-untyped-call]
                    continue
                cumulative = 0
                for bound, count in zip((*item.buckets, math.inf), item.counts, strict=True):
                    cumulative += count
                    le = floatToGoString(bound)  # type: ignore[no-untyped-call]
                    lines.append(f"{name}_bucket{_labels((*key, ('le', le)))} {cumulative}")
                lines.append(f"{name}_sum{_labels(key)} {floatToGoString(item.total)}")  # type: ignore[no-untyped-call]
                lines.append(f"{name}_count{_labels(key)} {cumulative}")
        return "".join(line + "\n" for line in lines)

    # -- under the lock --------------------------------------------------------------------------------
    def _family(self, name: str) -> _Family:
        family = self._families.get(name) if isinstance(name, str) else None
        if family is None:
            raise CustomMetricsError(f"metric family {str(name)[:MAX_NAME]!r} is not declared")
        return family

    def _check_family_cap(self, model: str) -> None:
        held = sum(1 for f in self._families.values() if model in f.declared_by)
        if held >= self.max_families_per_model:
            raise CustomMetricsError(
                f"model {model!r} already declares {held} metric families, the most a "
                "model may (edgeserve bounds custom metrics per model)"
            )

    def _series(
        self, model: str, fam: _Family, labels: Mapping[str, str], buckets: Sequence[float] | None
    ) -> _Series:
        key = _label_key(fam.name, labels, histogram=fam.kind == "histogram")
        series = fam.series.get(key)
        if series is not None:
            return series
        if fam.kind == "histogram":
            bounds = _buckets(fam.name, fam.kind, buckets) if buckets is not None else fam.buckets
            if bounds is None:
                raise CustomMetricsError(
                    f"metric family {fam.name!r} is a histogram: its metric needs buckets"
                )
        elif buckets is not None:
            raise CustomMetricsError(
                f"metric family {fam.name!r} is a {fam.kind}: buckets are only for histograms"
            )
        held = self._series_of.get(model, 0)
        if held >= self.max_series_per_model:
            raise CustomMetricsError(
                f"model {model!r} already holds {held} metric series (label sets), the "
                "most a model may (edgeserve bounds custom metrics per model)"
            )
        if sum(self._series_of.values()) >= self.max_series:
            raise CustomMetricsError(
                f"the server already holds {self.max_series} custom metric series, the "
                "most it keeps for all models together"
            )
        series = _Series(model)
        if fam.kind == "histogram":
            assert bounds is not None
            series.buckets, series.counts = bounds, [0] * (len(bounds) + 1)
        fam.series[key] = series
        self._series_of[model] = held + 1
        return series


def _kind(kind: object) -> str:
    text = str(kind).lower() if isinstance(kind, str) else ""
    if text not in KINDS:
        raise CustomMetricsError(f"unknown metric kind {str(kind)[:40]!r}; use COUNTER, GAUGE or HISTOGRAM")
    return text


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME:
        raise CustomMetricsError(
            f"metric family name {str(name)[:MAX_NAME]!r} is not a Prometheus metric name "
            f"([a-zA-Z_:][a-zA-Z0-9_:]*, at most {MAX_NAME} characters)"
        )
    if name.startswith(RESERVED_PREFIXES):
        raise CustomMetricsError(
            f"metric family name {name!r} uses a prefix of the built-in metrics "
            f"({', '.join(RESERVED_PREFIXES)}); choose another"
        )


def _sample_names(name: str, kind: str) -> tuple[str, ...]:
    return tuple(name + s for s in _HISTOGRAM_SUFFIXES) if kind == "histogram" else (name,)


def _finite(family: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CustomMetricsError(f"metric family {str(family)[:MAX_NAME]!r}: the value must be a number")
    number = float(value)
    if not math.isfinite(number):
        raise CustomMetricsError(
            f"metric family {str(family)[:MAX_NAME]!r}: the value must be finite, not {number}"
        )
    return number


def _buckets(name: str, kind: str, buckets: Sequence[float]) -> tuple[float, ...]:
    if kind != "histogram":
        raise CustomMetricsError(f"metric family {name!r} is a {kind}: buckets are only for histograms")
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise CustomMetricsError(f"metric family {name!r}: buckets must be a list of numbers")
    if len(buckets) > MAX_BUCKETS:
        raise CustomMetricsError(f"metric family {name!r}: at most {MAX_BUCKETS} buckets")
    bounds = tuple(_finite(name, b) for b in buckets)
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise CustomMetricsError(f"metric family {name!r}: bucket bounds must increase ({list(bounds)})")
    return bounds


def _label_key(family: str, labels: Mapping[str, str] | None, histogram: bool = False) -> LabelKey:
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise CustomMetricsError(f"metric family {str(family)[:MAX_NAME]!r}: labels must be a dictionary")
    if len(labels) > MAX_LABELS:
        raise CustomMetricsError(f"metric family {family!r}: at most {MAX_LABELS} labels per metric")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL.match(key) or len(key) > MAX_NAME or key.startswith("__"):
            raise CustomMetricsError(
                f"metric family {family!r}: label name {str(key)[:MAX_NAME]!r} is not a "
                "Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                "not starting with __)"
            )
        if histogram and key == "le":
            raise CustomMetricsError(f"metric family {family!r}: 'le' is the histogram's own bucket label")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE:
            raise CustomMetricsError(
                f"metric family {family!r}: label {key!r} must have a string value of at "
                f"most {MAX_LABEL_VALUE} characters"
            )
    return tuple(sorted(labels.items()))


def _bucket_index(bounds: tuple[float, ...], value: float) -> int:
    for index, bound in enumerate(bounds):
        if value <= bound:
            return index
    return len(bounds)


def _copy(series: _Series) -> _Series:
    return _Series(series.owner, series.value, series.buckets, list(series.counts), series.total)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(key: LabelKey) -> str:
    if not key:
        return ""
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in key)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(key, escaped, strict=True)) + "}"


CUSTOM_METRICS = CustomMetrics()
