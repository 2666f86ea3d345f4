"""Overload: a real server at 4x its capacity, open-loop (Poisson arrivals), per frontend.

For each of HTTP, gRPC and ZeroMQ: measure capacity closed-loop (8 clients back to back), then offer
`--factor` (4) x that rate with Poisson arrivals for `--seconds` (20): arrivals never wait for
answers, as cameras do not. Reports offered / served / rejected per second, the accepted requests'
p50/p99 (from each request's scheduled arrival, so client-side queueing counts), the rejections'
p99, the server's RSS before and after, and the recovery: the time from the end of the load until
a request is answered as fast as before it. Then ZeroMQ fairness: one camera flooding at 4x the
capacity beside two cameras at 15% each; each camera's share of its frames served.

    python benchmarks/bench_overload.py [--seconds 20] [--factor 4] [--json out.json]

The model is a synthetic ONNX MatMul chain (a few ms per row on one thread, batch up to 8), so
the model, not Python, is the bottleneck, as with a real vision model on an edge box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.es_server import RunningServer, start_server  # noqa: E402

MODEL = "chain"
DIM = 256
LAYERS = 24
WEIGHTS = 8


def build_repository(root: Path, layers: int = LAYERS) -> Path:
    from tests.onnx_models import build_matmul_chain

    repo = root / "models"
    # a few weight matrices shared by every layer: a slow model stays a small file
    build_matmul_chain(repo / MODEL / "1" / "model.onnx", layers, DIM, weights=WEIGHTS)
    (repo / MODEL / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching {}\n'
        "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
    )
    return repo


def pin_cores(server: RunningServer, spec: str) -> str:
    """`--pin SERVER:CLIENT` (CPU lists, e.g. 1:0): every thread of the server on SERVER's CPUs, this
    load generator on CLIENT's, so the two do not take each other's CPU. Returns what was done."""
    import os

    server_cpus, client_cpus = ({int(c) for c in part.split(",")} for part in spec.split(":"))
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), server_cpus)
    os.sched_setaffinity(0, client_cpus)
    return f"server on CPU {sorted(server_cpus)}, load generator on CPU {sorted(client_cpus)}"


def rss_mb(server: RunningServer) -> float:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# -- one request per frontend: returns "ok", "rejected" or "error:<text>" ----------------------------
class Frontend:
    name = ""

    async def open(self, server: RunningServer) -> None: ...

    async def call(self, x: np.ndarray) -> str: ...

    async def close(self) -> None: ...


class Http(Frontend):
    name = "http"

    async def open(self, server: RunningServer) -> None:
        import aiohttp

        # every load-generator connection comes from 127.0.0.1: the server's per-address limit is
        # raised for the benchmark (EDGESERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT below)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=400))
        self.url = f"{server.base}/v2/models/{MODEL}/infer"

    async def call(self, x: np.ndarray) -> str:
        # encoded once per frame: the load generator's CPU is what limits the offered rate on a small box
        if getattr(self, "_frame", None) is not x:
            self._frame = x
            self._body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                                 "data": x.ravel().tolist()}]}).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.url, data=self._body, headers=headers) as resp:
            await resp.read()
            if resp.status == 200:
                return "ok"
            return "rejected" if resp.status == 503 else f"error:{resp.status}"

    async def close(self) -> None:
        await self.session.close()


class Grpc(Frontend):
    name = "grpc"

    async def open(self, server: RunningServer) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.mod = grpcclient
        self.client = grpcclient.InferenceServerClient(server.grpc_url)

    async def call(self, x: np.ndarray) -> str:
        from tritonclient.utils import InferenceServerException

        inp = self.mod.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        try:
            await self.client.infer(MODEL, [inp])
        except InferenceServerException as exc:
            status = str(exc.status())
            if "UNAVAILABLE" in status or "RESOURCE_EXHAUSTED" in status:
                return "rejected"
            return f"error:{status}:{exc.message()}"
        return "ok"

    async def close(self) -> None:
        await self.client.close()


class Zmq(Frontend):
    name = "zmq"

    async def open(self, server: RunningServer, identity: bytes | None = None) -> None:
        from edgeserve.client import AsyncZmqClient

        self.client = AsyncZmqClient(server.zmq_endpoint, timeout=30.0, identity=identity)

    async def call(self, x: np.ndarray) -> str:
        from edgeserve.client import ClientError

        try:
            future = await self.client.submit(MODEL, {"x": x})
            await future
        except ClientError as exc:
            if exc.status in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
                return "rejected"
            return f"error:{exc}"
        return "ok"

    async def close(self) -> None:
        close = self.client.close()
        if asyncio.iscoroutine(close):
            await close


# -- load shapes -----------------------------------------------------------------------------------
async def closed_loop(
    front: Frontend, x: np.ndarray, seconds: float, clients: int = 8
) -> tuple[float, float]:
    """(answers per second, p50 latency ms) with `clients` back-to-back callers."""
    stop = time.monotonic() + seconds
    latencies: list[float] = []

    async def worker() -> None:
        while time.monotonic() < stop:
            start = time.monotonic()
            if await front.call(x) == "ok":
                latencies.append((time.monotonic() - start) * 1000)

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return len(latencies) / (time.monotonic() - start), pct(latencies, 50)


async def open_loop(
    front: Frontend, x: np.ndarray, rate: float, seconds: float, seed: int = 1
) -> dict[str, Any]:
    rng = random.Random(seed)
    ok: list[float] = []
    rejected: list[float] = []
    errors: dict[str, int] = {}
    tasks: set[asyncio.Task[None]] = set()

    lags: list[float] = []

    async def one(arrival: float) -> None:
        # how late the load generator itself starts the request: when this grows, the client (not the
        # server) is saturated and the latencies below are mostly its own queueing
        lags.append((time.monotonic() - arrival) * 1000)
        outcome = await front.call(x)
        latency = (time.monotonic() - arrival) * 1000
        if outcome == "ok":
            ok.append(latency)
        elif outcome == "rejected":
            rejected.append(latency)
        else:
            errors[outcome[:120]] = errors.get(outcome[:120], 0) + 1

    start = time.monotonic()
    next_at = start
    sent = 0
    while True:
        next_at += rng.expovariate(rate)
        if next_at - start >= seconds:
            break
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(next_at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
    load_end = time.monotonic()
    if tasks:
        await asyncio.wait(tasks, timeout=60)
    return {
        "offered_per_s": sent / seconds, "served_per_s": len(ok) / seconds,
        "rejected_per_s": len(rejected) / seconds, "errors": errors,
        "ok_p50_ms": pct(ok, 50), "ok_p99_ms": pct(ok, 99), "ok_max_ms": max(ok, default=float("nan")),
        "reject_p99_ms": pct(rejected, 99), "load_end": load_end,
        "client_start_lag_p50_ms": pct(lags, 50), "client_start_lag_p99_ms": pct(lags, 99),
        "unanswered": len(tasks),
    }  # fmt: skip


async def recovery(front: Frontend, x: np.ndarray, since: float, baseline_ms: float) -> float:
    """Seconds from `since` until a request is answered within 2x (+1 ms) the idle latency."""
    while time.monotonic() - since < 60:
        start = time.monotonic()
        if await front.call(x) == "ok" and (time.monotonic() - start) * 1000 <= 2 * baseline_ms + 1:
            return time.monotonic() - since
    return float("nan")


async def bench_frontend(front: Frontend, server: RunningServer, args: argparse.Namespace) -> dict[str, Any]:
    x = np.random.default_rng(0).random((1, DIM), dtype=np.float32)
    await front.open(server)
    try:
        for _ in range(50):
            await front.call(x)
        idle_p50 = (await closed_loop(front, x, 1.0, clients=1))[1]
        capacity, _ = await closed_loop(front, x, args.capacity_seconds)
        rss_before = rss_mb(server)
        result = await open_loop(front, x, args.factor * capacity, args.seconds)
        rss_after = rss_mb(server)
        result["recovery_s"] = await recovery(front, x, result.pop("load_end"), idle_p50)
        await asyncio.sleep(1.0)
        result.update(
            frontend=front.name, capacity_per_s=capacity, idle_p50_ms=idle_p50,
            rss_before_mb=rss_before, rss_after_mb=rss_after, rss_settled_mb=rss_mb(server),
        )  # fmt: skip
        return result
    finally:
        await front.close()


async def bench_fairness(server: RunningServer, capacity: float, args: argparse.Namespace) -> dict[str, Any]:
    """One flooding camera at factor x capacity, two at 15% of capacity each, over ZeroMQ."""
    x = np.random.default_rng(0).random((1, DIM), dtype=np.float32)
    cameras = [Zmq(), Zmq(), Zmq()]
    for i, cam in enumerate(cameras):
        await cam.open(server, identity=f"camera-{i}".encode())
    rates = [args.factor * capacity, 0.15 * capacity, 0.15 * capacity]
    try:
        results = await asyncio.gather(
            *(
                open_loop(cam, x, rate, args.seconds, seed=i + 7)
                for i, (cam, rate) in enumerate(zip(cameras, rates, strict=True))
            )
        )
    finally:
        for cam in cameras:
            await cam.close()
    out = {}
    for i, result in enumerate(results):
        result.pop("load_end")
        share = result["served_per_s"] / result["offered_per_s"] if result["offered_per_s"] else float("nan")
        out[f"camera{i}"] = {"offered_per_s": result["offered_per_s"], "served_per_s": result["served_per_s"],
                             "served_share": share, "ok_p99_ms": result["ok_p99_ms"]}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--capacity-seconds", type=float, default=5.0)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--frontends", default="http,grpc,zmq")
    parser.add_argument("--no-fairness", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--pin", help="SERVER:CLIENT CPU lists (e.g. 1:0): keep the load generator off the server's CPUs"
    )
    parser.add_argument(
        "--layers", type=int, default=LAYERS, help="MatMul layers of the model: more = a slower model"
    )
    args = parser.parse_args()
    report: dict[str, Any] = {"frontends": []}
    with tempfile.TemporaryDirectory(prefix="edgeserve-overload-") as tmp_name:
        tmp = Path(tmp_name)
        repo = build_repository(tmp, args.layers)
        server = start_server(
            repo,
            tmp,
            env={"EDGESERVE_RUNTIME_CPU_THREADS": "1", "EDGESERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT": "512"},
        )
        try:
            if args.pin:
                report["pinned"] = pin_cores(server, args.pin)
                print(report["pinned"], flush=True)
            for name in args.frontends.split(","):
                front = {"http": Http, "grpc": Grpc, "zmq": Zmq}[name]()
                result = asyncio.run(bench_frontend(front, server, args))
                report["frontends"].append(result)
                print(json.dumps(result), flush=True)
            if not args.no_fairness:
                zmq_capacity = next(
                    (r["capacity_per_s"] for r in report["frontends"] if r["frontend"] == "zmq"), 0
                )
                if zmq_capacity:
                    report["fairness"] = asyncio.run(bench_fairness(server, zmq_capacity, args))
                    print(json.dumps(report["fairness"]), flush=True)
            report["server_alive"] = server.alive()
        finally:
            server.stop()
    print()
    print(f"{args.factor:g}x capacity, open-loop Poisson arrivals, {args.seconds:g} s per frontend")
    print(
        "| frontend | capacity/s | offered/s | served/s | rejected/s | errors | ok p50 ms | ok p99 ms "
        "| reject p99 ms | RSS before → after MB | recovery s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["frontends"]:
        print(f"| {r['frontend']} | {r['capacity_per_s']:.0f} | {r['offered_per_s']:.0f} "
              f"| {r['served_per_s']:.0f} "
              f"| {r['rejected_per_s']:.0f} | {sum(r['errors'].values())} | {r['ok_p50_ms']:.1f} "
              f"| {r['ok_p99_ms']:.1f} | {r['reject_p99_ms']:.1f} | {r['rss_before_mb']:.0f} → "
              f"{r['rss_after_mb']:.0f} | {r['recovery_s']:.3f} |")  # fmt: skip
    if "fairness" in report:
        print("\nZeroMQ fairness (camera0 floods):")
        for cam, r in report["fairness"].items():
            print(f"  {cam}: offered {r['offered_per_s']:.0f}/s served {r['served_per_s']:.0f}/s "
                  f"({100 * r['served_share']:.0f}%), p99 {r['ok_p99_ms']:.1f} ms")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
