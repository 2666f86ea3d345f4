"""Side by side, in one run: the same ONNX model on the same runtime, called in-process vs through
edgeserve's HTTP frontend (KServe V2, binary tensors), with 1 and 8 concurrent clients.

    python benchmarks/bench_http.py                      # mlp and ppocr_det 1x3x320x320, onnxruntime
    python benchmarks/bench_http.py --backend plan       # the runtime plan's choice on both sides
    python benchmarks/bench_http.py --models mlp --seconds 5 --clients 1,4,8

Runtime (--backend, default onnxruntime): edgeserve serves a temporary copy of the sample repository
whose configs pin that backend (`plan`: models/ as it is, the plan's choice), and the in-process side
runs the same runtime with the same options, built from the choice the server makes (common.InProcess:
edgeserve's backend instances, as many as the config's instance_group, shared by N caller threads).
The server's chosen backend is read back from its model config and must match.
edgeserve = `edgeserve run` (configs as committed apart from the pin: dynamic batching etc.) on a free
loopback port, driven by N concurrent aiohttp requests from one event loop in this process. Phases
alternate A B per row. Loopback only; every loop is bounded by a request count and a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import (  # noqa: E402
    CpuMeter,
    InProcess,
    Result,
    Workload,
    add_backend_argument,
    machine_facts,
    merge,
    progress,
    run_connected,
    run_threads,
    served_workloads,
    start_server,
    workload_parser,
)


def http_body(work: Workload, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": work.input_name,
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + x.tobytes(), headers


def decode_http(payload: bytes, length: int) -> np.ndarray:
    header = json.loads(payload[:length])
    out = header["outputs"][0]
    array: np.ndarray = np.frombuffer(payload, dtype=np.float32, offset=length).reshape(out["shape"])
    return array


class HttpCaller:
    """Binary-tensor infer requests over one aiohttp session (opened inside the phase's event loop)."""

    def __init__(self, base: str, work: Workload, x: np.ndarray) -> None:
        self.url = f"{base}/v2/models/{work.model}/infer"
        self.body, self.headers = http_body(work, x)
        self.session: Any = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )

    async def __call__(self) -> None:
        async with self.session.post(self.url, data=self.body, headers=self.headers) as response:
            payload = await response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
            decode_http(payload, int(response.headers["Inference-Header-Content-Length"]))

    async def close(self) -> None:
        await self.session.close()


def http_phase(
    label: str,
    base: str,
    work: Workload,
    x: np.ndarray,
    clients: int,
    requests: int,
    seconds: float,
    meter: CpuMeter | None,
) -> Result:
    return run_connected(label, HttpCaller(base, work, x), clients, requests, seconds, meter)


def check_same_runtime(base: str, work: Workload, inproc: InProcess, x: np.ndarray) -> None:
    """Before timing: the server runs the in-process side's backend and returns its output."""
    import urllib.request

    body, headers = http_body(work, x)
    request = urllib.request.Request(f"{base}/v2/models/{work.model}/infer", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        got = decode_http(response.read(), int(response.headers["Inference-Header-Content-Length"]))
    want = inproc.infer({work.input_name: x})[work.output_name]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    progress(f"{work.model}: edgeserve output equals in-process {inproc.label}")


HEADER = "\n".join(
    (
        "| run                    | clients |   req/s |  p50 ms |  p99 ms | CPU bench/srv | ratio | errors |",
        "|------------------------|--------:|--------:|--------:|--------:|--------------:|------:|--------|",
    )
)


def fmt_row(r: Result, ratio: str = "") -> str:
    cpu = "/".join(f"{r.cpu.get(k, 0):.0f}%" for k in ("bench", "server"))
    errors = f"{r.errors}" if not r.first_error else f"{r.errors} ({r.first_error[:60]})"
    numbers = f"{r.throughput:>7.0f} | {r.p50_ms:>7.3f} | {r.p99_ms:>7.3f}"
    return f"| {r.label:<22} | {r.clients:>7} | {numbers} | {cpu:>13} | {ratio:>5} | {errors} |"


def main() -> int:
    parser = workload_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="time per side and row (all slices)")
    parser.add_argument(
        "--slices", type=int, default=5, help="alternating in-process / edgeserve slices per row"
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured warm-up per phase")
    add_backend_argument(parser)
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    facts = machine_facts()
    rows: list[str] = []
    runtimes: list[str] = []
    with served_workloads(args) as (works, repository):
        progress(
            f"starting edgeserve on {repository} ({args.backend}) with {', '.join(w.model for w in works)}"
        )
        server = start_server(repository, [w.model for w in works])
        try:
            meter = CpuMeter({"bench": os.getpid(), "server": server.process.pid})
            for work in works:
                inproc = InProcess.matching(repository, work.model, server.base)
                x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
                check_same_runtime(server.base, work, inproc, x)
                runtimes.append(f"{work.model}: {inproc.label} on both sides")
                rows += measure(server.base, work, inproc, x, client_counts, meter, args)
                inproc.close()
        finally:
            server.stop()

    print(
        f"\n{facts}. --backend {args.backend}: {'; '.join(runtimes)}. Per row {args.seconds:.0f} s per side "
        f"in {args.slices} alternating slices. CPU = share of all cores used by this process (the load "
        "generator; for in-process rows, the runtime itself) / by the server process. "
        "ratio = edgeserve / in-process throughput.\n"
    )
    print(HEADER)
    for row in rows:
        print(row)
    return 0


def measure(
    base: str,
    work: Workload,
    inproc: InProcess,
    x: np.ndarray,
    client_counts: list[int],
    meter: CpuMeter,
    args: argparse.Namespace,
) -> list[str]:
    rows: list[str] = []

    def in_process() -> None:
        inproc.infer({work.input_name: x})

    for clients in client_counts:
        label = f"{work.model} {'x'.join(map(str, work.shape))}"
        progress(f"{label}: {clients} client(s): warm-up, then {args.slices} x (in-process, edgeserve)")
        run_threads("warmup", in_process, clients, work.max_requests, args.warmup)
        http_phase("warmup", base, work, x, clients, work.max_requests, args.warmup, None)
        slice_s = args.seconds / args.slices
        budget = max(1, work.max_requests // args.slices)
        parts_a: list[Result] = []
        parts_b: list[Result] = []
        for _ in range(args.slices):  # A B A B: the box is noisy, only interleaved ratios mean much
            parts_a.append(
                run_threads(f"{work.model} in-process", in_process, clients, budget, slice_s, meter)
            )
            parts_b.append(
                http_phase(f"{work.model} edgeserve", base, work, x, clients, budget, slice_s, meter)
            )
        a, b = merge(parts_a), merge(parts_b)
        ratio = b.throughput / a.throughput if a.throughput else float("nan")
        rows += [fmt_row(a), fmt_row(b, f"{ratio:.2f}")]
        progress(
            f"{label}: {clients} client(s): in-process {a.throughput:.0f}/s, edgeserve "
            f"{b.throughput:.0f}/s, ratio {ratio:.2f}"
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
