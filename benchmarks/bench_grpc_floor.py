"""The floor under "gRPC unary at least as fast as HTTP": grpcio's own server against aiohttp's, with no
edgeserve code in either, side by side in one run.

Each server answers a 200-byte unary request with 64 bytes and does nothing else: a `grpc.aio` server
and a sync `grpc.server` (thread pool) with a generic bytes-in/bytes-out handler, as edgeserve
registers ModelInfer, both with the GRPC_EXPERIMENTS edgeserve's server sets, and an aiohttp server
with one POST route. The clients are the kinds `edgeserve bench` uses (one `grpc.aio` channel per lane;
one aiohttp session), one request in flight per lane, each in a process of its own. Rounds rotate the
order; the servers not being measured are paused (SIGSTOP). The report gives requests/s per cell
(median over rounds) and the ratio of each gRPC server to HTTP: where that ratio is under 1, a Python
gRPC server cannot match HTTP on a request that small, whatever it does inside its handler.

    python benchmarks/bench_grpc_floor.py --rounds 4 --seconds 3

Loopback only; every phase is bounded in time; only the processes started here are stopped, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, PausedTree, bench_parser, cpu_flags, free_port, machine_facts, progress

from edgeserve.cli import GRPC_EXPERIMENTS

FLAGS = ("avx2", "avx512f", "avx512_vnni", "amx_tile")
SERVERS = ("grpc-aio", "grpc-sync", "http")
REPLY_BYTES, REQUEST_BYTES = 64, 200

SERVER = """
import asyncio, sys
from concurrent import futures
import grpc
kind, port, reply = sys.argv[1], int(sys.argv[2]), b"r" * int(sys.argv[3])
def same(data): return data
def handlers(call):
    method = grpc.unary_unary_rpc_method_handler(call, request_deserializer=same, response_serializer=same)
    return (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": method}),)
if kind == "grpc-aio":
    async def answer(request, context): return reply
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(handlers(answer))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())
elif kind == "grpc-sync":
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers(handlers(lambda request, context: reply))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
else:
    from aiohttp import web
    async def answer(request):
        await request.read()
        return web.Response(body=reply)
    app = web.Application()
    app.router.add_post("/infer", answer)
    async def main():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
"""

CLIENT = """
import asyncio, json, sys, time
kind, port, lanes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seconds, size = float(sys.argv[4]), int(sys.argv[5])
body = b"q" * size
async def main():
    done = 0
    if kind.startswith("grpc"):
        import grpc
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(lanes)]
        calls = [c.unary_unary("/inference.GRPCInferenceService/ModelInfer") for c in channels]
        async def call(lane): await calls[lane](body, timeout=30)
        async def close():
            for channel in channels: await channel.close()
    else:
        import aiohttp
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = f"http://127.0.0.1:{port}/infer"
        async def call(lane):
            async with session.post(url, data=body) as response:
                await response.read()
                assert response.status == 200
        async def close(): await session.close()
    async def lane(index, until):
        nonlocal done
        while time.monotonic() < until:
            await call(index)
            done += 1
    await asyncio.gather(*(lane(i, time.monotonic() + 1.0) for i in range(lanes)))  # warm-up
    done, cpu, start = 0, time.process_time(), time.monotonic()
    await asyncio.gather(*(lane(i, start + seconds) for i in range(lanes)))
    wall = time.monotonic() - start
    used = time.process_time() - cpu
    print(json.dumps({"rate": done / wall, "client_cpu_us": 1e6 * used / max(1, done)}))
    await close()
asyncio.run(main())
"""


def start(kind: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    env = {**os.environ, "GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, kind, str(port), str(REPLY_BYTES)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise SystemExit(f"the {kind} server did not start")
    return process, port


def measure(kind: str, port: int, lanes: int, seconds: float) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, kind, str(port), str(lanes), str(seconds), str(REQUEST_BYTES)],
        capture_output=True, text=True, timeout=seconds + 60, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{kind} client failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    lane_counts = [int(n) for n in args.clients.split(",")]
    facts = f"{machine_facts()}; CPU flags: {cpu_flags(FLAGS)}"
    servers = {kind: start(kind) for kind in SERVERS}
    paused = {kind: PausedTree() for kind in SERVERS}
    rates: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    try:
        for kind in SERVERS:
            paused[kind].pause(servers[kind][0].pid)
        for lanes in lane_counts:
            for rnd in range(args.rounds):
                order = SERVERS[rnd % 3 :] + SERVERS[: rnd % 3]
                for kind in order:
                    paused[kind].resume()
                    result = measure(kind, servers[kind][1], lanes, args.seconds)
                    paused[kind].pause(servers[kind][0].pid)
                    rates.setdefault((kind, lanes), []).append(result["rate"])
                    cpu.setdefault((kind, lanes), []).append(result["client_cpu_us"])
                    progress(
                        f"{lanes} client(s) round {rnd + 1}/{args.rounds}: {kind} {result['rate']:,.0f}/s"
                    )
    finally:
        for kind, (process, _) in servers.items():
            paused[kind].resume()
            process.kill()
            process.wait(10)
    report(args, lane_counts, rates, cpu, facts)
    return 0


def report(
    args: argparse.Namespace,
    lane_counts: list[int],
    rates: dict[tuple[str, int], list[float]],
    cpu: dict[tuple[str, int], list[float]],
    facts: str,
) -> None:
    print(f"\n{facts}")
    print(f"{REQUEST_BYTES} B in, {REPLY_BYTES} B out, no work in the handler; GRPC_EXPERIMENTS as edgeserve "
          "sets it; median requests/s over the rounds (client CPU µs per request)\n")  # fmt: skip
    print("| clients | grpc.aio | grpc sync | aiohttp | grpc.aio / HTTP (per round) | grpc sync / HTTP |")
    print("|--:|--:|--:|--:|--:|--:|")
    rows = []
    for lanes in lane_counts:
        cells = {k: statistics.median(rates[(k, lanes)]) for k in SERVERS}
        client = {k: statistics.median(cpu[(k, lanes)]) for k in SERVERS}
        per_round = [a / h for a, h in zip(rates[("grpc-aio", lanes)], rates[("http", lanes)], strict=True)]
        sync_ratio = statistics.median(
            s / h for s, h in zip(rates[("grpc-sync", lanes)], rates[("http", lanes)], strict=True)
        )
        rows.append({"clients": lanes, "rates": cells, "client_cpu_us": client,
                     "aio_over_http": per_round, "sync_over_http": sync_ratio})  # fmt: skip
        text = " | ".join(f"{cells[k]:,.0f} ({client[k]:.0f})" for k in SERVERS)
        rounds = ", ".join(f"{r:.2f}" for r in per_round)
        print(f"| {lanes} | {text} | {statistics.median(per_round):.2f} ({rounds}) | {sync_ratio:.2f} |")
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"bench_grpc_floor-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "machine": facts, "rows": rows}, indent=2))
    progress(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())
