"""bench_peers.py's report: the markdown table (ratios to in-process and to the best peer of the same
row group), what ran on every side, which peers were skipped and why, and issue 14's targets."""

from __future__ import annotations

from typing import Any

PEERS = ("pytriton", "mlserver", "ray")
TINY = "mlp"


def _ratio(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.4f}"


def best_peer(rows: list[dict[str, Any]], model: str, clients: int) -> dict[str, Any] | None:
    mine = [r for r in rows if r["model"] == model and r["clients"] == clients and r["side"] in PEERS]
    return max(mine, key=lambda r: r["rps"]) if mine else None


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 14: with 8 clients edgeserve over gRPC is ahead of every peer (each model); tiny model, 8
    clients: gRPC >= 2x the best peer's request rate, ZeroMQ + shm >= 5x. Unary and stream each."""
    out: list[dict[str, Any]] = []
    for model in dict.fromkeys(r["model"] for r in rows):
        best = best_peer(rows, model, 8)
        if best is None:
            continue
        want = [("gRPC unary", 1.0), ("gRPC stream", 1.0)]
        if model == TINY:
            want = [("gRPC unary", 2.0), ("gRPC stream", 2.0), ("ZeroMQ + shm", 5.0)]
        for transport, factor in want:
            es = next(
                (
                    r
                    for r in rows
                    if r["model"] == model
                    and r["clients"] == 8
                    and r["side"] == "edgeserve"
                    and r["transport"] == transport
                ),
                None,
            )
            if es is None:
                continue
            ratio = es["rps"] / best["rps"] if best["rps"] else float("inf")
            met = ratio >= factor if factor > 1 else ratio > 1.0
            out.append(
                {
                    "model": model,
                    "transport": transport,
                    "edgeserve_rps": es["rps"],
                    "best_peer": f"{best['side']} {best['transport']}",
                    "best_peer_rps": best["rps"],
                    "ratio": ratio,
                    "target": f">= {factor:g}x" if factor > 1 else "ahead (> 1x)",
                    "met": met,
                }
            )
    return out


def render(report: dict[str, Any]) -> str:
    rows: list[dict[str, Any]] = report["rows"]
    lines = [f"{report.get('machine', '')}. {report.get('netns', '')}".strip(), ""]
    lines += [f"- {s}" for s in report["setup"]]
    for peer in PEERS:
        ran = any(r["side"] == peer for r in rows)
        if peer in report["skipped"]:
            lines.append(f"- {peer}: **skipped**: {report['skipped'][peer]}")
        elif not ran and report["args"].get("peers", "").count(peer):
            lines.append(f"- {peer}: not measured")
    for name, why in report["skipped"].items():
        if name not in PEERS:
            lines.append(f"- {name}: left out: {why}")
    args = report["args"]
    procs = report.get("client_processes")
    clients = (
        f"Remote rows driven from {procs} client processes (the N clients spread over them, one event "
        "loop each; the same callers for every side). "
        if procs
        else "Remote rows driven from one event loop in the benchmark process. "
    )
    lines += [
        "",
        clients + f"{args.get('seconds')} s per phase after {args.get('warmup')} s of warm-up, "
        f"{args.get('rounds')} interleaved round(s), median round kept; whole run {report.get('seconds')} s. "
        "CPU = share of all cores: this load generator / the measured server's process tree / the "
        "other servers (idle) together."
        + (
            " The servers not being measured were paused (SIGSTOP to their process trees) meanwhile."
            if report.get("paused_idle")
            else ""
        ),
        "",
    ]
    lines += [
        "| model | clients | side | transport | req/s | p50 ms | p99 ms | CPU gen / server / others "
        "| vs in-process | vs best peer | errors |",
        "|---|--:|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        group = [r for r in rows if r["model"] == row["model"] and r["clients"] == row["clients"]]
        base = next((r["rps"] for r in group if r["side"] == "in-process"), 0.0)
        best = best_peer(rows, row["model"], row["clients"])
        vs_base = _ratio(row["rps"] / base) if base else ""
        vs_best = (
            f"{row['rps'] / best['rps']:.2f}" if best and best["rps"] and row["side"] != "in-process" else ""
        )
        cpu = f"{row['cpu_bench']:.0f}% / {row['cpu_server']:.0f}% / {row['cpu_others']:.0f}%"
        errors = str(row["errors"]) + (f" ({row['first_error'][:60]})" if row["errors"] else "")
        lines.append(
            f"| {row['model']} | {row['clients']} | {row['side']} | {row['transport'] or '-'} | "
            f"{row['rps']:,.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {cpu} | {vs_base} | "
            f"{vs_best} | {errors} |"
        )
    if report.get("targets"):
        lines += ["", "Targets (issue 14, 8 clients, against the best peer row of the same model):", ""]
        for t in report["targets"]:
            lines.append(
                f"- {t['model']}: edgeserve {t['transport']} {t['edgeserve_rps']:,.0f}/s = "
                f"{t['ratio']:.2f}x {t['best_peer']} {t['best_peer_rps']:,.0f}/s (target {t['target']}): "
                f"**{'met' if t['met'] else 'NOT met'}**"
            )
    elif rows:
        lines += ["", "Targets: not checked (no peer row with 8 clients)."]
    return "\n".join(lines)
