"""`tune`'s results: the records file (JSON lines, one per finished candidate), the Pareto frontier of
throughput against p99, the best point within the budget, and the winning config.pbtxt."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def model_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "config.pbtxt"):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def device_fingerprint() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{platform.machine()}|{model}|{os.cpu_count()}"


@dataclass(frozen=True)
class Measured:
    """One (candidate, concurrency) point of a finished candidate."""

    key: str
    label: str
    concurrency: int
    throughput: float
    p99_ms: float
    p50_ms: float


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """Finished candidates by key; a torn last line (the run was killed mid-write) is skipped."""
    records: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                records[str(record["key"])] = record
    return records


def append_record(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()


def points_of(record: Mapping[str, Any]) -> list[Measured]:
    if record.get("status") != "ok":
        return []
    return [
        Measured(
            record["key"],
            record["label"],
            int(p["concurrency"]),
            float(p["throughput"]),
            float(p["p99_ms"]),
            float(p["p50_ms"]),
        )
        for p in record.get("points", [])
        if not p.get("errors") and p.get("requests") and not math.isnan(float(p["p99_ms"] or math.nan))
    ]


def score(record: Mapping[str, Any] | None, budget_ms: float) -> float | None:
    """A candidate's best throughput within the budget (0 when none is); None: not measured / failed."""
    if record is None or record.get("status") != "ok":
        return None
    within = [p.throughput for p in points_of(record) if p.p99_ms <= budget_ms]
    return max(within, default=0.0)


def frontier(points: Iterable[Measured]) -> list[Measured]:
    """The Pareto frontier: no other point has at least the throughput at no more p99 (one strictly)."""
    ordered = sorted(points, key=lambda p: (p.p99_ms, -p.throughput))
    found: list[Measured] = []
    best = -1.0
    for point in ordered:
        if point.throughput > best:
            found.append(point)
            best = point.throughput
    return found


def best_within(points: Iterable[Measured], budget_ms: float) -> Measured | None:
    within = [p for p in points if p.p99_ms <= budget_ms]
    return max(within, key=lambda p: (p.throughput, -p.p99_ms), default=None)


def render(records: Sequence[Mapping[str, Any]], budget_ms: float) -> tuple[str, Measured | None]:
    """The candidates table, the frontier table and the best point (None: nothing within budget)."""
    lines = [f"{'candidate':40} {'status':9} {'best infer/s':>12} {'at c':>5} {'p99 ms':>8}  accuracy"]
    for record in records:
        mine = best_within(points_of(record), budget_ms)
        accuracy = record.get("accuracy") or {}
        acc = accuracy.get("note") or (
            f"err/scale {accuracy['max_err_over_range']:.2g}, cos {accuracy['cosine_min']:.5f}"
            + (f", top-1 {accuracy['top1_agreement']:.0%}" if "top1_agreement" in accuracy else "")
            if "max_err_over_range" in accuracy
            else "-"
        )
        status = str(record.get("status", "?"))
        lowest = min(points_of(record), key=lambda p: p.p99_ms, default=None)
        if mine is None and lowest is not None:  # measured, but even its lowest p99 is over the budget
            label = record["label"]
            lines.append(
                f"{label:40} {'over':9} {'-':>12} {lowest.concurrency:5d} {lowest.p99_ms:8.2f}  {acc}"
            )
        elif mine is None:
            why = "" if status in ("ok", "rejected") else str(record.get("error", ""))[:60]
            lines.append(f"{record['label']:40} {status:9} {'-':>12} {'-':>5} {'-':>8}  {acc} {why}".rstrip())
        else:
            lines.append(
                f"{record['label']:40} {status:9} {mine.throughput:12.1f} {mine.concurrency:5d} "
                f"{mine.p99_ms:8.2f}  {acc}"
            )
    lines.append(
        f"(best infer/s: the most throughput with p99 within {budget_ms:g} ms; over: no point within it, "
        "its lowest p99 shown)"
    )
    every = [p for r in records for p in points_of(r)]
    best = best_within(every, budget_ms)
    lines += [
        "",
        f"frontier (throughput against p99; budget {budget_ms:g} ms):",
        f"  {'candidate':40} {'c':>4} {'infer/s':>10} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    for p in frontier(every):
        mark = (
            "  <- best within budget" if p == best else ("" if p.p99_ms <= budget_ms else "  (over budget)")
        )
        lines.append(
            f"  {p.label:40} {p.concurrency:4d} {p.throughput:10.1f} {p.p50_ms:8.2f} {p.p99_ms:8.2f}{mark}"
        )
    return "\n".join(lines), best


def write_config(path: Path, config: Any, best: Measured, budget_ms: float, protocol: str) -> None:
    """The winning config as Triton text format, with what was measured in a comment on top."""
    from google.protobuf import text_format

    header = (
        f"# Written by `edgeserve tune` on {time.strftime('%Y-%m-%d %H:%M:%S')}: {best.label}\n"
        f"# {best.throughput:.1f} inferences/s at {best.concurrency} concurrent requests over {protocol}, "
        f"p99 {best.p99_ms:.2f} ms (budget {budget_ms:g} ms), p50 {best.p50_ms:.2f} ms, on this device.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + text_format.MessageToString(config))
