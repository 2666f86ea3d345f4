"""gRPC unary vs HTTP vs gRPC streaming on the sample models, side by side in one run, interleaved.

One edgeserve server per variant (a source tree: this one, ".", or another checkout such as main's,
run from that tree), serving the sample repository (models/). For every model and client count,
round after round, every (variant, protocol) pair runs `edgeserve bench MODEL -i PROTOCOL
--concurrency N` (the load generator the issue's figures come from: pre-serialized requests, one
request in flight per lane) in an order rotated each round; the servers not being measured are paused
(SIGSTOP). The table gives the median infer/s per cell over the rounds, and the check "gRPC unary at
least as fast as HTTP" per model and client count (median of the per-round ratios, and in how many
rounds it held).

    python benchmarks/bench_transports.py                                  # every sample model, 1/4/8
    python benchmarks/bench_transports.py --models ppocr_cls --clients 4 --rounds 4
    git archive main | (mkdir -p /tmp/es-main && tar -x -C /tmp/es-main)
    python benchmarks/bench_transports.py --variant main=/tmp/es-main --variant new=. --models ppocr_cls

`accumulate` (a stateful sequence model: every request needs a sequence id) is left out: the bench
sends stateless requests. The OCR ensemble gets a 480x640 RGB frame, ppocr_det 1x3x320x320,
ppocr_rec 3x48x320. Loopback only; every phase is bounded in time; only the servers started here
are stopped, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fastpath_ab import FLAGS, Variant, measure_only, parse_variant, servers
from common import ROOT, bench_parser, cpu_flags, machine_facts, progress
from es_server import RunningServer

PROTOCOLS = ("http", "grpc", "grpc-stream")
SHAPES = {"ppocr_det": ["x:1,3,320,320"], "ppocr_rec": ["x:3,48,320"], "ocr": ["IMAGE:480,640,3"]}
DEFAULT_MODELS = ("mlp", "ppocr_det", "ppocr_cls", "ppocr_rec", "ocr")


def bench(
    server: RunningServer, model: str, protocol: str, clients: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One `edgeserve bench` point (this tree's bench for every variant: the same load generator)."""
    url = server.grpc_url if protocol.startswith("grpc") else server.http_url
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    shapes = [arg for shape in SHAPES.get(model, []) for arg in ("--shape", shape)]
    cmd = [sys.executable, "-m", "edgeserve", "bench", model, "-i", protocol, "-u", url,
           "--http-url", server.http_url, "--concurrency", str(clients), "--quiet", "--warmup-s",
           str(args.warmup), "--window-s", str(args.window), "--max-windows", str(args.windows),
           "--json", str(out), *shapes]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        if done.returncode != 0:
            raise RuntimeError(f"bench {model} {protocol} x{clients} failed:\n{done.stderr[-2000:]}")
        point: dict[str, Any] = json.loads(out.read_text())["points"][-1]
    finally:
        out.unlink(missing_ok=True)
    return point


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--variant", action="append", help="name=SOURCE_TREE[:EDGESERVE_KEY=VALUE,...]")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=1.0, help="s of load before each point")
    parser.add_argument("--window", type=float, default=2.0, help="s per measurement window")
    parser.add_argument("--windows", type=int, default=3, help="windows per point (the last 3 are merged)")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["new=."]]
    models = [m for m in args.models.split(",") if m]
    clients = [int(c) for c in args.clients.split(",") if c]
    protocols = [p for p in args.protocols.split(",") if p]
    tmp = Path(tempfile.mkdtemp(prefix="es-transports-"))
    facts = f"{machine_facts()}; CPU flags: {cpu_flags(FLAGS)}"
    results: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    loads = ["--host", "127.0.0.1", *(arg for model in models for arg in ("--load-model", model))]
    with servers(variants, ROOT / "models", tmp, loads, timeout=600):
        cells = [(v, p) for v in variants for p in protocols]
        for model in models:
            for n in clients:
                for rnd in range(args.rounds):
                    shift = rnd % len(cells)
                    for variant, protocol in cells[shift:] + cells[:shift]:
                        measure_only(variants, variant)
                        assert variant.server is not None
                        point = bench(variant.server, model, protocol, n, args)
                        results.setdefault((model, n, variant.name, protocol), []).append(point)
                        rate = f"{point['throughput']:.1f} infer/s, p50 {point['p50_ms']:.2f} ms"
                        progress(f"{model} x{n} round {rnd + 1}: {variant.name} {protocol} {rate}")
        report(args, variants, models, clients, protocols, results, facts)
    return 0


def report(
    args: argparse.Namespace,
    variants: list[Variant],
    models: list[str],
    clients: list[int],
    protocols: list[str],
    results: dict[tuple[str, int, str, str], list[dict[str, Any]]],
    facts: str,
) -> None:
    print(f"\n{facts}")
    print(f"edgeserve bench, {args.rounds} rounds, order rotated; median infer/s (p50 ms); "
          f"unary/HTTP: median of the per-round ratios (rounds where unary >= HTTP)\n")  # fmt: skip
    head = " | ".join(f"{v.name} {p}" for v in variants for p in protocols)
    print(f"| model | clients | {head} | " + " | ".join(f"{v.name} unary/HTTP" for v in variants) + " |")
    print("|---|---:|" + "---:|" * (len(variants) * len(protocols) + len(variants)))
    rows = []
    for model in models:
        for n in clients:
            cells = []
            for v in variants:
                for p in protocols:
                    points = results[(model, n, v.name, p)]
                    rate = statistics.median(pt["throughput"] for pt in points)
                    p50 = statistics.median(pt["p50_ms"] for pt in points)
                    cells.append(f"{rate:,.1f} ({p50:.2f})")
            ratios = []
            for v in variants:
                if "grpc" in protocols and "http" in protocols:
                    grpc = [pt["throughput"] for pt in results[(model, n, v.name, "grpc")]]
                    http = [pt["throughput"] for pt in results[(model, n, v.name, "http")]]
                    per_round = [g / h if h else 0.0 for g, h in zip(grpc, http, strict=True)]
                    held = sum(r >= 1.0 for r in per_round)
                    ratio = statistics.median(per_round)
                    ratios.append(f"{ratio:.2f} ({held}/{len(per_round)})")
                    rows.append({"model": model, "clients": n, "variant": v.name, "unary_over_http": ratio,
                                 "per_round": per_round})  # fmt: skip
                else:
                    ratios.append("-")
            print(f"| {model} | {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"bench_transports-{time.strftime('%Y%m%d-%H%M%S')}.json"
    raw = {"|".join(map(str, key)): points for key, points in results.items()}
    out.write_text(
        json.dumps({"args": vars(args), "machine": facts, "ratios": rows, "points": raw}, indent=2)
    )
    progress(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
