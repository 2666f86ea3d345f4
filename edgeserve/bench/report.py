"""The bench's results as a table (stdout), CSV and JSON (documented columns: `Point.columns()`)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edgeserve.bench.inputs import ModelInfo
from edgeserve.bench.stats import Point

COLUMN_DOCS: dict[str, str] = {
    "protocol": "http | http-json | grpc | grpc-stream | zmq | zmq-shm",
    "model": "model name",
    "batch_size": "inputs per request",
    "concurrency": "requests in flight (closed loop); 0 in request-rate mode",
    "request_rate": "offered Poisson request rate, requests/s; 0 in concurrency mode",
    "sent_per_s": "requests sent per second (achieved offered rate)",
    "throughput": "inferences per second (answered requests x batch size)",
    "requests": "answered requests in the merged windows",
    "errors": "failed requests in the merged windows",
    "p50_ms": "latency percentiles and average, client side, ms",
    "server_queue_us": "server-side average per request from the statistics deltas, us",
    "server_batch": "requests per execution on the server (dynamic batching)",
    "client_cpu_pct": "this process's CPU time over wall time (100 = one core)",
    "late": "Poisson arrivals sent over 1 ms late (the client could not keep up)",
    "windows": "measurement windows run; the point merges the last 3",
    "stable": "the last 3 windows agreed within --stability-pct",
    "seconds": "length of the merged windows",
    "first_error": "the first failure's message",
}


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else f"{value:.{digits}f}"


def table(points: Sequence[Point]) -> str:
    """An aligned text table, one line per load point."""
    head = [
        "load",
        "infer/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "errors",
        "queue us",
        "input us",
        "infer us",
        "output us",
        "batch",
        "client cpu%",
    ]
    several = len({p.protocol for p in points}) > 1
    rows = [head]
    for p in points:
        load = (f"{p.protocol} " if several else "") + p.label + ("" if p.stable else "*")
        if p.request_rate:
            load += f" (sent {p.sent_per_s:.1f}/s)"
        rows.append(
            [
                load,
                _fmt(p.throughput, 1),
                _fmt(p.p50_ms),
                _fmt(p.p90_ms),
                _fmt(p.p99_ms),
                _fmt(p.max_ms),
                str(p.errors),
                _fmt(p.server_queue_us, 0),
                _fmt(p.server_compute_input_us, 0),
                _fmt(p.server_compute_infer_us, 0),
                _fmt(p.server_compute_output_us, 0),
                _fmt(p.server_batch),
                _fmt(p.client_cpu_pct, 0),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    if any(not p.stable for p in points):
        lines.append("* not stable within --stability-pct in --max-windows (or cut by --max-seconds)")
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def write_csv(path: Path, points: Sequence[Point]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=Point.columns())
        writer.writeheader()
        for point in points:
            writer.writerow({k: "" if _clean(v) is None else v for k, v in point.row().items()})


def write_json(path: Path, points: Sequence[Point], info: ModelInfo, extra: Mapping[str, Any]) -> None:
    document = {
        "model": {
            "name": info.name,
            "version": info.version,
            "platform": info.platform,
            "max_batch_size": info.max_batch_size,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in info.inputs],
        },
        "run": dict(extra),
        "columns": Point.columns(),
        "points": [{k: _clean(v) for k, v in p.row().items()} for p in points],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
