"""A/B of server settings, side by side in one run: one edgeserve server per variant (each variant is
a set of EDGESERVE_* environment settings), all started at once on the same model; then, round after
round, every transport on every variant, the variants' order rotated each round and the servers not
being measured paused (SIGSTOP), so slow drift and order effects hit every variant alike. Prints
every round and the medians with their ratio to the first variant.

    python benchmarks/bench_ab.py --variant asyncio:EDGESERVE_SERVER_EVENT_LOOP=asyncio \\
        --variant uvloop:EDGESERVE_SERVER_EVENT_LOOP=uvloop --rounds 6
    python benchmarks/bench_ab.py --variant spin200: --variant spin0:EDGESERVE_ZMQ_SPIN_US=0 \\
        --transports "ZeroMQ + shm" --clients 1

The clients are bench_peers' (peer_clients.py: tritonclient's asyncio clients, edgeserve's
AsyncZmqClient), one event loop in this process. Only the servers started here are stopped.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import Side
from common import ROOT, WORKLOADS, Result, Workload, bench_parser, progress, run_connected
from es_server import RunningServer, start_server
from peer_clients import CALLERS

TRANSPORTS = ("gRPC unary", "gRPC stream", "HTTP", "ZeroMQ", "ZeroMQ + shm")  # edgeserve's, in CALLERS
DEFAULT_TRANSPORTS = ("gRPC unary", "gRPC stream", "HTTP", "ZeroMQ + shm")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """A variant given as "name:KEY=VALUE,KEY=VALUE" (an empty list: the defaults)."""
    name, _, settings = text.partition(":")
    env = dict(item.split("=", 1) for item in settings.split(",") if item)
    if not name or any(not key.startswith("EDGESERVE_") for key in env):
        raise SystemExit(f"--variant {text!r}: expected name:EDGESERVE_KEY=VALUE,... (the list may be empty)")
    return name, env


def addresses(server: RunningServer) -> dict[str, str]:
    grpc, http, zmq = server.grpc_url, server.http_url, server.zmq_endpoint
    return dict(zip(TRANSPORTS, (grpc, grpc, http, zmq, zmq), strict=True))


def drive(
    address: str, transport: str, work: Workload, x: np.ndarray, clients: int, seconds: float
) -> Result:
    caller = CALLERS[transport](address, work, x, clients)
    return run_connected(transport, caller, clients, work.max_requests, seconds)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--variant", action="append", required=True, help="name:EDGESERVE_KEY=VALUE,...")
    parser.add_argument("--model", default="mlp", choices=("mlp", "ppocr_cls", "ppocr_det", "ppocr_rec"))
    parser.add_argument("--transports", default=",".join(DEFAULT_TRANSPORTS), help="comma list")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if len(variants) < 2 or len({name for name, _ in variants}) != len(variants):
        raise SystemExit("give at least two --variant, with different names")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise SystemExit(f"unknown transport(s) {unknown}; one of: {', '.join(TRANSPORTS)}")
    work = WORKLOADS[args.model]
    x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    sides: list[Side] = []
    try:
        for name, env in variants:
            progress(f"starting edgeserve '{name}' {env or '(defaults)'} with {args.model}")
            folder = tmp / name
            folder.mkdir()
            flags = ["--host", "127.0.0.1", "--log-level", "WARNING", "--load-model", args.model]
            server = start_server(ROOT / "models", folder, env=env, timeout=240, args=flags)
            sides.append(Side(name, server.process.pid, addresses(server), server.stop))
        rates: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):
            shift = rnd % len(sides)
            for transport in transports:
                for side in sides[shift:] + sides[:shift]:
                    for other in sides:
                        if other is side:
                            other.resume()
                        else:
                            other.pause()
                    drive(side.addresses[transport], transport, work, x, args.clients, args.warmup)
                    result = drive(side.addresses[transport], transport, work, x, args.clients, args.seconds)
                    rates.setdefault((transport, side.name), []).append(result.throughput)
                    progress(f"round {rnd + 1}/{args.rounds} {transport} {side.name}: "
                             f"{result.throughput:,.0f}/s, errors {result.errors}")  # fmt: skip
        base = sides[0].name
        print(f"\n{args.model}, {args.clients} clients, {args.rounds} rounds of {args.seconds:g} s; "
              f"median req/s (ratio to '{base}'; rounds at or above '{base}')\n")  # fmt: skip
        print("| transport | " + " | ".join(side.name for side in sides) + " |")
        print("|---|" + "--:|" * len(sides))
        for transport in transports:
            first = rates[(transport, base)]
            cells = []
            for side in sides:
                mine = rates[(transport, side.name)]
                ratio = statistics.median(mine) / statistics.median(first)
                wins = sum(m >= f for m, f in zip(mine, first, strict=True))
                extra = "" if side.name == base else f" ({ratio:.3f}; {wins} of {len(mine)})"
                cells.append(f"{statistics.median(mine):,.0f}{extra}")
            print(f"| {transport} | " + " | ".join(cells) + " |")
    finally:
        for side in sides:
            side.resume()
            side.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
