"""Side by side, in one run: the same ONNX model called in-process (onnxruntime) vs edgeserve over gRPC
unary (ModelInfer), gRPC streaming (ModelStreamInfer) and HTTP, with 1 and 8 concurrent clients, and
(where `nvidia-pytriton` installs) a real Triton server (PyTriton 0.7.0) serving the same model through
the same clients.

    python benchmarks/bench_grpc.py                           # mlp and ppocr_det 1x3x320x320, 1 and 8 clients
    python benchmarks/bench_grpc.py --models mlp --seconds 4 --clients 1,4,8
    python benchmarks/bench_grpc.py --no-pytriton             # edgeserve only
    python benchmarks/bench_grpc.py --rounds 3                # A B C .. x3 interleaved, median kept

- in-process: one `onnxruntime.InferenceSession` with edgeserve's session options, N threads.
- edgeserve: `python -m edgeserve run` on the sample repository (models/, its config.pbtxt: dynamic
  batching etc.), free loopback ports. Clients are tritonclient's asyncio clients in this process,
  N concurrent tasks on one event loop: gRPC unary = N channels with one request in flight each,
  gRPC stream = N streams with one request in flight each, HTTP = one aiohttp pool.
- PyTriton: a real `tritonserver` (bundled in the nvidia-pytriton wheel) whose Python model runs the
  same ONNX file in the same onnxruntime (same session options), dynamic batching with the same
  max batch size and queue delay as the edgeserve config. It is installed into a throwaway venv
  (`--pytriton-venv`, created on first use with `--system-site-packages`) and run as a separate
  process from that venv; if it cannot be installed or started, the reason is printed and it is skipped.

Loopback only; every phase is bounded by a request count and a time limit; only processes started
here are stopped, by their process id.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Result, free_port, progress, run_async, run_threads

sys.path.insert(0, str(ROOT))  # edgeserve, when it is not installed

PYTRITON_VERSION = "0.7.0"
DEFAULT_VENV = Path.home() / ".cache" / "edgeserve-bench" / "pytriton-venv"


@dataclass(frozen=True)
class Workload:
    model: str
    input_name: str
    output_name: str
    shape: tuple[int, ...]
    max_requests: int  # per phase; the time limit usually ends it first
    max_batch_size: int  # as in models/<model>/config.pbtxt (PyTriton gets the same)
    queue_delay_us: int


WORKLOADS = {
    "mlp": Workload("mlp", "INPUT0", "OUTPUT0", (1, 16), 100_000, 8, 500),
    "ppocr_det": Workload("ppocr_det", "x", "sigmoid_0.tmp_0", (1, 3, 320, 320), 5_000, 4, 2000),
}


# -- processes ----------------------------------------------------------------------------------------
class Service:
    """A server process started here (edgeserve or PyTriton) on loopback ports."""

    def __init__(
        self, name: str, process: subprocess.Popen[bytes], http_port: int, grpc_port: int, log_path: Path
    ) -> None:
        self.name = name
        self.process = process
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.log_path = log_path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as response:
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
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


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


def pytriton_python(venv: Path, install: bool) -> tuple[str | None, str]:
    """(python of a venv where `import pytriton` works, or None; why not)."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import pytriton, onnxruntime, numpy"]
    if python.exists() and subprocess.run(check, capture_output=True, timeout=120).returncode == 0:
        return str(python), ""
    if not install:
        return None, f"no PyTriton venv at {venv} and --no-pytriton-install given"
    progress(f"installing nvidia-pytriton=={PYTRITON_VERSION} into a throwaway venv at {venv} (once) ...")
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"nvidia-pytriton=={PYTRITON_VERSION}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"creating the venv failed: {exc}"
    if pip.returncode != 0:
        return None, f"pip install nvidia-pytriton=={PYTRITON_VERSION} failed: {pip.stderr.strip()[-300:]}"
    if subprocess.run(check, capture_output=True, timeout=120).returncode != 0:
        return None, "nvidia-pytriton installed but `import pytriton, onnxruntime, numpy` fails in its venv"
    return str(python), ""


def start_pytriton(python: str, repository: Path, works: list[Workload]) -> Service:
    http_port, grpc_port = free_port(), free_port()
    log_path = Path(tempfile.gettempdir()) / f"pytriton-bench-{grpc_port}.log"
    base = subprocess.run(
        [python, "-c", "import sys, sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    libdir = base or str(sysconfig.get_config_var("LIBDIR"))
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p),
    }
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--serve-pytriton",
        "--model-repository",
        str(repository),
        "--models",
        ",".join(w.model for w in works),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    service = Service("pytriton", process, http_port, grpc_port, log_path)
    service.wait_ready(300, [w.model for w in works])
    return service


def serve_pytriton(args: argparse.Namespace) -> int:
    """Runs inside the PyTriton venv: a real tritonserver whose Python models call onnxruntime."""
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    sys.path.insert(0, str(ROOT))
    try:
        from edgeserve.backends.base import BackendOptions
        from edgeserve.backends.onnxruntime import session_options

        options = session_options(BackendOptions())
    except Exception as exc:  # a different numpy in this venv, say: same defaults by hand
        print(f"edgeserve session options unavailable ({exc}); using onnxruntime defaults without spinning")
        options = ort.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")

    workspace = Path(tempfile.gettempdir()) / f"pytriton-ws-{os.getpid()}-{time.time_ns()}"  # must not exist
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=args.http_port,
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        allow_metrics=False,
        exit_timeout_secs=10,
    )
    with Triton(config=config, workspace=str(workspace)) as triton:
        for name in args.models.split(","):
            work = WORKLOADS[name]
            session = ort.InferenceSession(
                str(Path(args.model_repository) / name / "1" / "model.onnx"),
                options,
                providers=["CPUExecutionProvider"],
            )

            def make(session: Any = session, work: Workload = work) -> Callable[..., dict[str, np.ndarray]]:
                @batch  # type: ignore[untyped-decorator]
                def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
                    (out,) = session.run([work.output_name], {work.input_name: inputs[work.input_name]})
                    return {work.output_name: out}

                return infer  # type: ignore[no-any-return]

            dims = (-1,) * (len(work.shape) - 2) if len(work.shape) > 2 else ()
            in_shape = (work.shape[1], *dims) if dims else work.shape[1:]
            triton.bind(
                model_name=name,
                infer_func=make(),
                inputs=[Tensor(name=work.input_name, dtype=np.float32, shape=in_shape)],
                outputs=[
                    Tensor(name=work.output_name, dtype=np.float32, shape=(-1,) * (len(work.shape) - 1))
                ],
                config=ModelConfig(
                    max_batch_size=work.max_batch_size,
                    batcher=DynamicBatcher(max_queue_delay_microseconds=work.queue_delay_us),
                ),
            )
        print("pytriton serving", args.models, flush=True)
        triton.serve()
    return 0


# -- CPU accounting over process trees -----------------------------------------------------------------
class TreeMeter:
    """CPU of each named process (and its children, for servers) between start() and stop(), as a share
    of all cores."""

    def __init__(self, pids: dict[str, tuple[int, bool]]) -> None:
        """name -> (pid, with its children)."""
        self.roots = {name: (psutil.Process(pid), tree) for name, (pid, tree) in pids.items()}
        self._start: dict[str, float] = {}
        self._procs: dict[str, list[psutil.Process]] = {}
        self._t0 = 0.0

    @staticmethod
    def _used(processes: list[psutil.Process]) -> float:
        total = 0.0
        for p in processes:
            try:
                times = p.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def start(self) -> None:
        self._procs = {}
        for name, (root, tree) in self.roots.items():
            try:
                self._procs[name] = [root, *root.children(recursive=True)] if tree else [root]
            except psutil.Error:
                self._procs[name] = [root]
        self._start = {name: self._used(procs) for name, procs in self._procs.items()}
        self._t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        cores = psutil.cpu_count() or 1
        return {
            name: 100.0 * (self._used(procs) - self._start[name]) / (wall * cores)
            for name, procs in self._procs.items()
        }


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


class _Stream:
    def __init__(self, client: Any, work: Workload, inputs: list[Any], outputs: list[Any]) -> None:
        self.client, self.work = client, work
        self.request = {"model_name": work.model, "inputs": inputs, "outputs": outputs}
        self.requests: asyncio.Queue[Any] = asyncio.Queue()

        async def feed() -> Any:
            while True:
                item = await self.requests.get()
                if item is None:
                    return
                yield item

        self.responses = client.stream_infer(feed())

    async def roundtrip(self) -> None:
        self.requests.put_nowait(dict(self.request))
        result, error = await self.responses.__anext__()
        if error is not None:
            raise error
        if result.as_numpy(self.work.output_name) is None:
            raise RuntimeError("no output")


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
    progress(f"{work.model}: {service.name} gRPC and HTTP outputs equal in-process onnxruntime")


def remote_phase(
    label: str,
    transport: str,
    service: Service,
    work: Workload,
    x: np.ndarray,
    clients: int,
    seconds: float,
    meter: TreeMeter | None,
) -> Result:
    url = service.http_url if transport == "HTTP" else service.grpc_url
    caller = TRANSPORTS[transport](url, work, x, clients)
    return run_async(
        label,
        caller,
        clients,
        work.max_requests,
        seconds,
        meter,  # type: ignore[arg-type]
        setup=caller.open,
        teardown=caller.close,
    )


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="mlp,ppocr_det", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--clients", default="1,8", help="comma list of concurrent client counts")
    parser.add_argument("--seconds", type=float, default=5.0, help="time limit per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the median is kept")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "models")
    parser.add_argument("--no-pytriton", action="store_true", help="leave the PyTriton peer out")
    parser.add_argument("--no-pytriton-install", action="store_true", help="use the venv only if it exists")
    parser.add_argument("--pytriton-venv", type=Path, default=DEFAULT_VENV)
    # internal: the PyTriton server process
    parser.add_argument("--serve-pytriton", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_pytriton:
        return serve_pytriton(args)

    works = [WORKLOADS[m] for m in args.models.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]
    from edgeserve.samples import prepare

    prepare(args.model_repository, with_ppocr=any(w.model.startswith("ppocr") for w in works))
    import onnxruntime as ort

    from edgeserve.backends.base import BackendOptions
    from edgeserve.backends.onnxruntime import session_options

    progress(f"starting edgeserve on {args.model_repository} with {', '.join(w.model for w in works)}")
    services = [start_edgeserve(args.model_repository, works)]
    skipped = ""
    if args.no_pytriton:
        skipped = "--no-pytriton given"
    else:
        python, skipped = pytriton_python(args.pytriton_venv, not args.no_pytriton_install)
        if python is not None:
            progress("starting PyTriton (real tritonserver) with the same models ...")
            try:
                services.append(start_pytriton(python, args.model_repository, works))
            except Exception as exc:
                skipped = f"PyTriton did not start: {exc}"
    if skipped:
        progress(f"PyTriton peer skipped: {skipped}")

    rows: list[str] = []
    ratios: list[str] = []
    try:
        meter = TreeMeter(
            {"bench": (os.getpid(), False), **{s.name: (s.process.pid, True) for s in services}}
        )
        for work in works:
            path = args.model_repository / work.model / "1" / "model.onnx"
            session = ort.InferenceSession(
                str(path), session_options(BackendOptions()), providers=["CPUExecutionProvider"]
            )
            x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
            (want,) = session.run([work.output_name], {work.input_name: x})
            for service in services:
                check_outputs(service, work, want, x)

            def in_process(session: Any = session, work: Workload = work, x: np.ndarray = x) -> None:
                session.run([work.output_name], {work.input_name: x})

            for clients in client_counts:
                tag = f"{work.model} {'x'.join(map(str, work.shape))}, {clients} client(s)"
                runs: dict[str, list[Result]] = {}
                for round_no in range(args.rounds):  # A B C .. A B C: noise hits every phase alike
                    suffix = f" (round {round_no + 1}/{args.rounds})" if args.rounds > 1 else ""
                    progress(f"{tag}: in-process{suffix} ...")
                    run_threads("warmup", in_process, clients, work.max_requests, args.warmup)
                    r = run_threads("in-process", in_process, clients, work.max_requests, args.seconds,
                                    meter)  # type: ignore[arg-type]  # fmt: skip
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
                    rows.append(fmt_row(work.model, r, base.throughput, server_key))
                ratios.append(ratio_line(tag, chosen))
    finally:
        for service in services:
            service.stop()

    import platform

    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"onnxruntime {ort.__version__}, {args.seconds:.0f}s per phase after {args.warmup:.0f}s warm-up. "
        "CPU = share of all cores used by this load generator / by the server's process tree. "
        "vs in-process = throughput / in-process throughput in the same row group."
    )
    if skipped:
        print(f"PyTriton peer skipped: {skipped}")
    print()
    print(HEADER)
    for row in rows:
        print(row)
    print("\nRatios:")
    for line in ratios:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
