"""Latency against throughput as a PNG (matplotlib, an optional extra: `pip install 'edgeserve[plot]'`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgeserve.bench.errors import BenchError
from edgeserve.bench.stats import Point

PLOT_HINT = "pip install 'edgeserve[plot]'"


def plot(path: Path, points: Sequence[Point], title: str, budget_ms: float | None = None) -> None:
    """p50 and p99 latency (y) against throughput (x), one pair of curves per protocol."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError(f"--plot needs matplotlib: {PLOT_HINT}") from None
    figure, axes = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        for protocol in dict.fromkeys(p.protocol for p in points):
            mine = [p for p in points if p.protocol == protocol]  # in load order, as measured
            xs = [p.throughput for p in mine]
            (line,) = axes.plot(xs, [p.p99_ms for p in mine], marker="o", label=f"{protocol} p99")
            axes.plot(
                xs,
                [p.p50_ms for p in mine],
                marker=".",
                linestyle="--",
                color=line.get_color(),
                label=f"{protocol} p50",
            )
            for p in mine:
                axes.annotate(
                    p.label, (p.throughput, p.p99_ms), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        if budget_ms is not None:
            axes.axhline(budget_ms, color="red", linestyle=":", label=f"budget {budget_ms:g} ms")
        values = [v for p in points for v in (p.p50_ms, p.p99_ms) if v > 0]  # nan compares false
        if values and max(values) > 20 * min(values):
            axes.set_yscale("log")  # a wide range: the fast points stay readable
        axes.set_xlabel("throughput (inferences/s)")
        axes.set_ylabel("latency (ms)")
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
