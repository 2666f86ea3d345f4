"""Side by side, in one run: the same ONNX model on the same runtime, called in-process vs edgeserve over
gRPC unary (ModelInfer), gRPC streaming (ModelStreamInfer) and HTTP, with 1 and 8 concurrent clients,
and (where `nvidia-pytriton` installs) a real Triton server (PyTriton 0.7.0) serving the same model on the
same runtime through the same clients.

    python benchmarks/bench_grpc.py                           # mlp and ppocr_det 1x3x320x320, onnxruntime
    python benchmarks/bench_grpc.py --backend plan            # the runtime plan's choice everywhere
    python benchmarks/bench_grpc.py --models mlp --seconds 4 --clients 1,4,8
    python benchmarks/bench_grpc.py --no-pytriton             # edgeserve only
    python benchmarks/bench_grpc.py --rounds 3                # A B C .. x3 interleaved, median kept

- runtime (--backend, default onnxruntime): edgeserve serves a temporary copy of the sample repository
  whose configs pin that backend (`plan`: models/ as it is); in-process and PyTriton run the backend and
  options edgeserve chooses for that config (common.InProcess: edgeserve's backend instances, as many as
  the config's instance_group). The server's choice is read back from its model config and must match.
- in-process: those instances called from N threads, one call per instance at a time.
- edgeserve: `python -m edgeserve run` on that repository (dynamic batching etc. as configured), free
  loopback ports. Clients are tritonclient's asyncio clients in this process, N concurrent tasks on one
  event loop: gRPC unary = N channels with one request in flight each, gRPC stream = N streams with one
  request in flight each, HTTP = one aiohttp pool.
- PyTriton: a real `tritonserver` (bundled in the nvidia-pytriton wheel) whose Python model runs the
  same instances (same backend, options, count), with max_batch_size, preferred batch sizes and
  max_queue_delay_microseconds read from the model's config.pbtxt (max_batch_size 0: bound without
  batching, the model's own batch axis in the tensor shapes). It is installed into a throwaway venv
  (`--pytriton-venv`, created on first use with `--system-site-packages`) and run as a separate
  process from that venv; if it cannot be installed or started, the reason is printed and it is skipped.

Loopback only; every phase is bounded by a request count and a time limit; only processes started
here are stopped, by their process id.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pytriton_peer
from common import (
    ROOT,
    CpuMeter,
    InProcess,
    Result,
    Workload,
    add_backend_argument,
    free_port,
    machine_facts,
    progress,
    run_connected,
    run_threads,
    served_config,
    served_workloads,
    workload_parser,
)
from es_server import Endpoints, terminate
from peer_clients import Stream


# -- processes ----------------------------------------------------------------------------------------
@dataclass
class Service(Endpoints):
    """A server process started here (edgeserve or PyTriton) on loopback ports."""

    name: str
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log_path: Path

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float, models: list[str]) -> None:
        """Server ready and every model ready (PyTriton's server is ready before its models load)."""
        deadline = time.monotonic() + timeout
        paths = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in models)]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log: {self.log_path}")
            if all(self._ok(path) for path in paths):
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready within {timeout:.0f}s; log: {self.log_path}")

    def stop(self, timeout: float = 60.0) -> None:
        terminate(self.process, timeout)


def start_edgeserve(repository: Path, works: list[Workload]) -> Service:
    http_port, grpc_port = free_port(), free_port()
    log_path = Path(tempfile.gettempdir()) / f"edgeserve-bench-grpc-{grpc_port}.log"
    cmd = [
        sys.executable,
        "-m",
        "edgeserve",
        "run",
        "--model-repository",
        str(repository),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--no-zmq",
        "--log-level",
        "WARNING",
    ]
    for work in works:
        cmd += ["--load-model", work.model]
    env = {
        **os.environ,
        "EDGESERVE_SERVER_STATE_DIR": str(Path(tempfile.gettempdir()) / f"edgeserve-bench-{grpc_port}"),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    service = Service("edgeserve", process, http_port, grpc_port, log_path)
    service.wait_ready(240, [w.model for w in works])
    return service


# -- callers ------------------------------------------------------------------------------------------
class Pool:
    """N clients (or streams); each concurrent task takes one, so N tasks = N independent clients."""

    def __init__(self) -> None:
        self.free: asyncio.Queue[Any] = asyncio.Queue()
        self.all: list[Any] = []

    def add(self, item: Any) -> None:
        self.all.append(item)
        self.free.put_nowait(item)


class GrpcUnary:
    def __init__(self, url: str, work: Workload, x: np.ndarray, clients: int) -> None:
        self.url, self.work, self.x, self.clients = url, work, x, clients
        self.pool = Pool()

    async def open(self) -> None:
        import tritonclient.grpc.aio as aio

        for _ in range(self.clients):
            client = aio.InferenceServerClient(self.url)
            tensor = aio.InferInput(self.work.input_name, list(self.x.shape), "FP32")
            tensor.set_data_from_numpy(self.x)
            self.pool.add((client, [tensor], [aio.InferRequestedOutput(self.work.output_name)]))

    async def __call__(self) -> None:
        client, inputs, outputs = await self.pool.free.get()
        try:
            result = await client.infer(self.work.model, inputs, outputs=outputs)
            if result.as_numpy(self.work.output_name) is None:
                raise RuntimeError("no output")
        finally:
            self.pool.free.put_nowait((client, inputs, outputs))

    async def close(self) -> None:
        for client, _, _ in self.pool.all:
            await client.close()


class _Stream(Stream):
    def __init__(self, client: Any, work: Workload, inputs: list[Any], outputs: list[Any]) -> None:
        super().__init__(client, {"model_name": work.model, "inputs": inputs, "outputs": outputs})
        self.work = work

    async def roundtrip(self) -> Any:
        result = await super().roundtrip()
        if result.as_numpy(self.work.output_name) is None:
            raise RuntimeError("no output")
        return result


class GrpcStream(GrpcUnary):
    async def open(self) -> None:
        import tritonclient.grpc.aio as aio

        for _ in range(self.clients):
            client = aio.InferenceServerClient(self.url)
            tensor = aio.InferInput(self.work.input_name, list(self.x.shape), "FP32")
            tensor.set_data_from_numpy(self.x)
            self.pool.add(
                _Stream(client, self.work, [tensor], [aio.InferRequestedOutput(self.work.output_name)])
            )

    async def __call__(self) -> None:
        stream = await self.pool.free.get()
        try:
            await stream.roundtrip()
        finally:
            self.pool.free.put_nowait(stream)

    async def close(self) -> None:
        for stream in self.pool.all:
            stream.requests.put_nowait(None)
            await stream.client.close()


class Http(GrpcUnary):
    async def open(self) -> None:
        import tritonclient.http.aio as aio

        self.client = aio.InferenceServerClient(self.url, conn_limit=max(self.clients, 1))
        tensor = aio.InferInput(self.work.input_name, list(self.x.shape), "FP32")
        tensor.set_data_from_numpy(self.x, binary_data=True)
        self.inputs = [tensor]
        self.outputs = [aio.InferRequestedOutput(self.work.output_name, binary_data=True)]

    async def __call__(self) -> None:
        result = await self.client.infer(self.work.model, self.inputs, outputs=self.outputs)
        if result.as_numpy(self.work.output_name) is None:
            raise RuntimeError("no output")

    async def close(self) -> None:
        await self.client.close()


TRANSPORTS: dict[str, type[GrpcUnary]] = {"gRPC unary": GrpcUnary, "gRPC stream": GrpcStream, "HTTP": Http}


def check_outputs(service: Service, work: Workload, want: np.ndarray, x: np.ndarray) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    for name, mod, url in (("gRPC", grpcclient, service.grpc_url), ("HTTP", httpclient, service.http_url)):
        client = mod.InferenceServerClient(url)
        tensor = mod.InferInput(work.input_name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        got = client.infer(work.model, [tensor]).as_numpy(work.output_name)
        client.close()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{service.name} {name}")
    progress(f"{work.model}: {service.name} gRPC and HTTP outputs equal the in-process output")


def remote_phase(
    label: str,
    transport: str,
    service: Service,
    work: Workload,
    x: np.ndarray,
    clients: int,
    seconds: float,
    meter: CpuMeter | None,
) -> Result:
    url = service.http_url if transport == "HTTP" else service.grpc_url
    caller = TRANSPORTS[transport](url, work, x, clients)
    return run_connected(label, caller, clients, work.max_requests, seconds, meter)


# -- report -------------------------------------------------------------------------------------------
HEADER = (
    "| model | clients | run | req/s | p50 ms | p99 ms | CPU bench / server | vs in-process | errors |\n"
    "|---|--:|---|--:|--:|--:|--:|--:|---|"
)


def fmt_ratio(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.4f}"


def fmt_row(model: str, r: Result, base: float, server_key: str) -> str:
    cpu = f"{r.cpu.get('bench', 0):.0f}% / {r.cpu.get(server_key, 0):.0f}%" if r.cpu else ""
    ratio = fmt_ratio(r.throughput / base) if base else ""
    errors = f"{r.errors}" + (f" ({r.first_error[:60]})" if r.first_error else "")
    return (
        f"| {model} | {r.clients} | {r.label} | {r.throughput:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {cpu} "
        f"| {ratio} | {errors} |"
    )


def median_run(results: list[Result]) -> Result:
    """The round with the median throughput (rounds are interleaved, so this damps machine noise)."""
    return sorted(results, key=lambda r: r.throughput)[len(results) // 2]


def ratio_line(tag: str, chosen: dict[str, Result]) -> str:
    base = chosen["in-process"].throughput
    line = [f"{tag}: in-process {base:.0f}/s"]
    for transport in TRANSPORTS:
        es = chosen[f"edgeserve {transport}"].throughput
        text = f"edgeserve {transport} {es:.0f}/s = {fmt_ratio(es / base)}x in-process"
        peer = chosen.get(f"pytriton {transport}")
        if peer is not None and peer.throughput:
            text += f", {es / peer.throughput:.2f}x PyTriton"
        line.append(text)
    unary = chosen["edgeserve gRPC unary"].throughput
    if unary:
        line.append(f"edgeserve stream/unary {chosen['edgeserve gRPC stream'].throughput / unary:.2f}")
    return "; ".join(line)


def main() -> int:
    parser = workload_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="time limit per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the median is kept")
    add_backend_argument(parser)
    parser.add_argument("--no-pytriton", action="store_true", help="leave the PyTriton peer out")
    parser.add_argument("--no-pytriton-install", action="store_true", help="use the venv only if it exists")
    parser.add_argument("--pytriton-venv", type=Path, default=pytriton_peer.DEFAULT_VENV)
    args = parser.parse_args()

    facts = machine_facts()
    with served_workloads(args) as (works, repository):
        report = run(args, works, repository)

    print(
        f"\n{facts}. --backend {args.backend}: {'; '.join(report['runtimes'])}. "
        f"{args.seconds:.0f}s per phase after {args.warmup:.0f}s warm-up, {args.rounds} round(s) (median "
        "kept). CPU = share of all cores used by this load generator / by the server's process tree. "
        "vs in-process = throughput / in-process throughput in the same row group."
    )
    print(f"PyTriton peer: {report['skipped'] or '; '.join(report['peer'])}")
    print()
    print(HEADER)
    for row in report["rows"]:
        print(row)
    print("\nRatios:")
    for line in report["ratios"]:
        print(f"- {line}")
    return 0


def run(args: argparse.Namespace, works: list[Workload], repository: Path) -> dict[str, Any]:
    """Start the servers on `repository`, measure every row, stop them; the report's parts."""
    client_counts = [int(c) for c in args.clients.split(",")]
    report: dict[str, Any] = {"rows": [], "ratios": [], "runtimes": [], "peer": [], "skipped": ""}
    progress(f"starting edgeserve on {repository} ({args.backend}) with {', '.join(w.model for w in works)}")
    services = [start_edgeserve(repository, works)]
    inprocs: dict[str, InProcess] = {}
    try:
        for work in works:
            inproc = inprocs[work.model] = InProcess.matching(
                repository, work.model, f"http://{services[0].http_url}"
            )
            report["runtimes"].append(f"{work.model}: {inproc.label} on every side")
        if args.no_pytriton:
            report["skipped"] = "skipped: --no-pytriton given"
        else:
            python, why = pytriton_peer.pytriton_python(args.pytriton_venv, not args.no_pytriton_install)
            base, folder = f"http://{services[0].http_url}", Path(tempfile.mkdtemp(prefix="bench-grpc-"))
            specs = [pytriton_peer.peer_spec(served_config(base, w.model, folder), w, inprocs[w.model])
                     for w in works]  # fmt: skip
            report["peer"] = [pytriton_peer.describe_peer(spec) for spec in specs]
            if python is not None:
                progress("starting PyTriton (real tritonserver) with the same models and runtime ...")
                try:
                    process, http_port, grpc_port, log = pytriton_peer.start(python, specs)
                    service = Service("pytriton", process, http_port, grpc_port, log)
                    services.append(service)
                    service.wait_ready(300, [w.model for w in works])
                except Exception as exc:
                    why = f"PyTriton did not start: {exc}"
            if why:
                report["skipped"] = f"skipped: {why}"
                progress(f"PyTriton peer {report['skipped']}")
        pids = {"bench": os.getpid(), **{s.name: s.process.pid for s in services}}
        meter = CpuMeter(pids, with_children=[s.name for s in services])
        for work in works:
            measure(args, work, inprocs[work.model], services, client_counts, meter, report)
    finally:
        for service in services:
            service.stop()
        for inproc in inprocs.values():
            inproc.close()
    return report


def measure(
    args: argparse.Namespace,
    work: Workload,
    inproc: InProcess,
    services: list[Service],
    client_counts: list[int],
    meter: CpuMeter,
    report: dict[str, Any],
) -> None:
    x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
    want = inproc.infer({work.input_name: x})[work.output_name]
    for service in services:
        check_outputs(service, work, want, x)

    def in_process() -> None:
        inproc.infer({work.input_name: x})

    for clients in client_counts:
        tag = f"{work.model} {'x'.join(map(str, work.shape))}, {clients} client(s)"
        runs: dict[str, list[Result]] = {}
        for round_no in range(args.rounds):  # A B C .. A B C: noise hits every phase alike
            suffix = f" (round {round_no + 1}/{args.rounds})" if args.rounds > 1 else ""
            progress(f"{tag}: in-process{suffix} ...")
            run_threads("warmup", in_process, clients, work.max_requests, args.warmup)
            r = run_threads("in-process", in_process, clients, work.max_requests, args.seconds, meter)
            runs.setdefault("in-process", []).append(r)
            for service in services:
                for transport in TRANSPORTS:
                    label = f"{service.name} {transport}"
                    remote_phase("warmup", transport, service, work, x, clients, args.warmup, None)
                    r = remote_phase(label, transport, service, work, x, clients, args.seconds, meter)
                    runs.setdefault(label, []).append(r)
                    progress(f"{tag}: {label}{suffix} {r.throughput:.0f}/s, errors {r.errors}")
        chosen = {label: median_run(results) for label, results in runs.items()}
        base = chosen["in-process"]
        for label, r in chosen.items():
            server_key = label.split(" ", 1)[0] if label != "in-process" else "edgeserve"
            report["rows"].append(fmt_row(work.model, r, base.throughput, server_key))
        report["ratios"].append(ratio_line(tag, chosen))


if __name__ == "__main__":
    raise SystemExit(main())
