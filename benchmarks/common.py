"""Shared helpers for the side-by-side benchmarks: percentiles, a server process on free loopback
ports, bounded client loops (threads or asyncio), the CPU share of each side, progress lines, and what
keeps a comparison fair: a benchmark repository pinned to one runtime (`bench_repository`), the same
runtime called in-process with the server's own choice of options (`InProcess`), the model's config
read for peers (`read_config`), and the machine facts printed with every table (`machine_facts`).

Every loop is bounded by a request count and a time limit and stops by itself; only the processes
started here are stopped, by their process id. The server is started by tests/es_server.py, the same
helper the end-to-end tests use.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # es_server; edgeserve when it is not installed
from es_server import RunningServer, free_port  # noqa: E402
from es_server import start_server as _start_server  # noqa: E402

from edgeserve.bench.stats import percentile  # noqa: E402  (the same nearest-rank rule as `edgeserve bench`)

__all__ = ["BACKENDS", "ROOT", "WORKLOADS", "Connections", "CpuMeter", "InProcess", "PausedTree",
           "Result", "RunningServer", "Workload", "add_backend_argument", "bench_repository",
           "chosen_workloads", "free_port", "machine_facts", "merge", "percentile", "plan_selector",
           "prepare_samples", "progress", "read_config", "run_async", "run_connected",
           "run_threads", "served_config", "start_server", "workload_parser"]  # fmt: skip


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- CPU accounting ---------------------------------------------------------------------------------------
class CpuMeter:
    """CPU used by processes between start() and stop(), as a share of the whole machine (all cores).
    The processes named in `with_children` count with their children (as they are at start(): a server's
    workers); a process that is gone counts no more."""

    def __init__(self, pids: dict[str, int], with_children: Iterable[str] = ()) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.with_children = set(with_children)
        self._trees: dict[str, list[psutil.Process]] = {}
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    @staticmethod
    def _used(processes: list[psutil.Process]) -> float:
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def start(self) -> None:
        self._trees = {}
        for name, process in self.processes.items():
            try:
                children = process.children(recursive=True) if name in self.with_children else []
            except psutil.Error:
                children = []
            self._trees[name] = [process, *children]
        self._start = {name: self._used(tree) for name, tree in self._trees.items()}
        self._t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        cores = psutil.cpu_count() or 1
        return {
            name: 100.0 * (self._used(tree) - self._start[name]) / (wall * cores)
            for name, tree in self._trees.items()
        }


# -- results -----------------------------------------------------------------------------------------------
@dataclass
class Result:
    label: str
    clients: int
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    first_error: str = ""

    @property
    def throughput(self) -> float:
        return len(self.latencies_s) / self.seconds if self.seconds else 0.0

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_s, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_s, 99) * 1e3


def merge(parts: list[Result]) -> Result:
    """One result from interleaved slices of the same run (CPU shares weighted by slice time)."""
    total = Result(parts[0].label, parts[0].clients)
    for part in parts:
        total.latencies_s += part.latencies_s
        total.errors += part.errors
        total.seconds += part.seconds
        total.first_error = total.first_error or part.first_error
        for name, share in part.cpu.items():
            total.cpu[name] = total.cpu.get(name, 0.0) + share * part.seconds
    total.cpu = {name: value / total.seconds for name, value in total.cpu.items()} if total.seconds else {}
    return total


class _Budget:
    """Shared across workers: stop after `max_requests` started or `max_seconds` elapsed."""

    def __init__(self, max_requests: int, max_seconds: float) -> None:
        self.left = max_requests
        self.deadline = time.perf_counter() + max_seconds
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left <= 0 or time.perf_counter() >= self.deadline:
                return False
            self.left -= 1
            return True


def run_threads(
    label: str,
    call: Callable[[], None],
    clients: int,
    max_requests: int,
    max_seconds: float,
    meter: CpuMeter | None = None,
) -> Result:
    """`clients` threads each calling `call()` back to back until the shared budget runs out."""
    result = Result(label, clients)
    budget = _Budget(max_requests, max_seconds)
    lock = threading.Lock()

    def worker() -> None:
        local: list[float] = []
        while budget.take():
            t0 = time.perf_counter()
            try:
                call()
            except Exception as exc:
                with lock:
                    result.errors += 1
                    result.first_error = result.first_error or repr(exc)
                continue
            local.append(time.perf_counter() - t0)
        with lock:
            result.latencies_s.extend(local)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    if meter:
        meter.start()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 60)
    result.seconds = time.perf_counter() - t0
    if meter:
        result.cpu = meter.stop()
    return result


def run_async(
    label: str,
    call: Callable[[], Awaitable[None]],
    clients: int,
    max_requests: int,
    max_seconds: float,
    meter: CpuMeter | None = None,
    setup: Callable[[], Awaitable[None]] | None = None,
    teardown: Callable[[], Awaitable[None]] | None = None,
) -> Result:
    """`clients` concurrent asyncio tasks on one event loop (one load-generator thread); `setup` and
    `teardown` run in that loop, outside the measurement."""
    result = Result(label, clients)
    budget = _Budget(max_requests, max_seconds)

    async def worker() -> None:
        while budget.take():
            t0 = time.perf_counter()
            try:
                await call()
            except Exception as exc:
                result.errors += 1
                result.first_error = result.first_error or repr(exc)
                continue
            result.latencies_s.append(time.perf_counter() - t0)

    async def main() -> None:
        if setup is not None:
            await setup()
        try:
            if meter:
                meter.start()
            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), max_seconds + 60)
            result.seconds = time.perf_counter() - t0
            if meter:
                result.cpu = meter.stop()
        finally:
            if teardown is not None:
                await teardown()

    asyncio.run(main())
    return result


class Connections(Protocol):
    """A load generator's client: one request per call, over connections it opens and closes itself."""

    def __call__(self) -> Awaitable[Any]: ...
    def open(self) -> Awaitable[None]: ...
    def close(self) -> Awaitable[None]: ...


def run_connected(
    label: str,
    caller: Connections,
    clients: int,
    max_requests: int,
    max_seconds: float,
    meter: CpuMeter | None = None,
) -> Result:
    """`run_async` with the caller's connections opened before the measurement and closed after it."""
    return run_async(
        label, caller, clients, max_requests, max_seconds, meter, setup=caller.open, teardown=caller.close
    )


class PausedTree:
    """A process and its descendants stopped (SIGSTOP) while another server is measured: an idle
    server's timers and helper processes then take no CPU and cause no wake-ups in that phase."""

    def __init__(self) -> None:
        self.processes: list[psutil.Process] = []

    def pause(self, pid: int) -> None:
        if self.processes:
            return
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.suspend()
                self.processes.append(process)

    def resume(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(psutil.Error):
                process.resume()
        self.processes = []


# -- the server process ------------------------------------------------------------------------------------
def start_server(repository: Path, models: list[str], extra_args: list[str] | None = None,
                 timeout: float = 180.0) -> RunningServer:  # fmt: skip
    """`python -m edgeserve run` with only HTTP, on a free loopback port, loading only `models`
    (tests/es_server.py starts it; stop it with `.stop()`, which signals that process only)."""
    tmp = Path(tempfile.mkdtemp(prefix="edgeserve-bench-"))
    args = ["--no-grpc", "--no-zmq", "--log-level", "WARNING"]
    for model in models:
        args += ["--load-model", model]
    return _start_server(repository, tmp, args=args + (extra_args or []), timeout=timeout)


# -- workloads ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    model: str
    input_name: str
    output_name: str
    shape: tuple[int, ...]  # the request's full shape (batch 1 for batching models)
    max_requests: int  # per phase; the time limit usually ends it first


WORKLOADS = {
    "mlp": Workload("mlp", "INPUT0", "OUTPUT0", (1, 16), 100_000),
    "ppocr_det": Workload("ppocr_det", "x", "sigmoid_0.tmp_0", (1, 3, 320, 320), 5_000),
    "ppocr_cls": Workload("ppocr_cls", "x", "save_infer_model/scale_0.tmp_1", (1, 3, 48, 192), 50_000),
    "ppocr_rec": Workload("ppocr_rec", "x", "softmax_11.tmp_0", (1, 3, 48, 320), 10_000),
    # built by plan_models.py (not in models/)
    "resnet_nhwc": Workload("resnet_nhwc", "image", "probs", (1, 224, 224, 3), 2_000),
    "transformer": Workload("transformer", "tokens", "encoded", (1, 64, 256), 5_000),
    "wide_mlp": Workload("wide_mlp", "features", "probs", (1, 1024), 20_000),
}


# -- one runtime on both sides -----------------------------------------------------------------------------
BACKENDS = ("onnxruntime", "openvino", "plan")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="onnxruntime",
        help="runtime on both sides: serve a copy of the repository pinned to it (config `backend:`) and "
        "call the same runtime in-process; `plan` = the repository as it is, the runtime plan's choice, "
        "called in-process as chosen (default: onnxruntime)",
    )


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A bench's command line: its module text, as written, is the description `--help` shows."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def workload_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of every model-by-model bench: --models, --clients, --model-repository."""
    parser = bench_parser(doc)
    parser.add_argument("--models", default="mlp,ppocr_det", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--clients", default="1,8", help="comma list of concurrent client counts")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "models")
    return parser


def chosen_workloads(args: argparse.Namespace) -> list[Workload]:
    return [WORKLOADS[m] for m in args.models.split(",")]


def prepare_samples(repository: Path, works: list[Workload]) -> None:
    """The sample models in `repository` (the PP-OCR ones only when a workload needs them)."""
    from edgeserve.samples import prepare

    prepare(repository, with_ppocr=any(w.model.startswith("ppocr") for w in works))


def read_config(path: Path) -> Any:
    """A config.pbtxt as tritonclient's ModelConfig message (text format, as Triton reads it)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())


def served_config(http_base: str, model: str, folder: Path) -> Path:
    """The config a running edgeserve serves `model` with (completed from the model file where its
    config.pbtxt leaves things out), written as `<folder>/<model>.served.pbtxt`: what a peer is set
    up from."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    with urllib.request.urlopen(f"{http_base}/v2/models/{model}/config", timeout=30) as response:
        served = json.loads(response.read())
    config = json_format.ParseDict(served, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
    path = folder / f"{model}.served.pbtxt"
    path.write_text(text_format.MessageToString(config), encoding="utf-8")
    return path


_PIN = re.compile(r"^(backend|platform)\s*:")  # top-level fields only: they start a line in these configs


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def bench_repository(backend: str, models: list[str], source: Path) -> Iterator[Path]:
    """The repository one run serves. `plan`: `source` itself. Otherwise a temporary one (removed
    afterwards): per model, its version folders with the model files linked from `source` and its
    config.pbtxt copied with any `backend:`/`platform:` line replaced by `backend: "<backend>"`, so the
    server runs the runtime the in-process baseline runs, whatever the plan would pick."""
    if backend == "plan":
        yield source
        return
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {', '.join(BACKENDS)}")
    root = Path(tempfile.mkdtemp(prefix=f"edgeserve-bench-{backend}-"))
    try:
        for model in models:
            src, dst = source / model, root / model
            for version in sorted(p for p in src.iterdir() if p.is_dir() and p.name.isdigit()):
                (dst / version.name).mkdir(parents=True)
                # hard links (copies across filesystems): the server refuses a symlink out of a version folder
                shutil.copytree(version, dst / version.name, copy_function=_link_or_copy, dirs_exist_ok=True)
            config = src / "config.pbtxt"  # none: the server completes it from the model
            lines = config.read_text(encoding="utf-8").splitlines() if config.exists() else []
            text = "\n".join(line for line in lines if not _PIN.match(line))
            text += f'\n# pinned by benchmarks/common.py bench_repository\nbackend: "{backend}"\n'
            (dst / "config.pbtxt").write_text(text, encoding="utf-8")
            pinned = read_config(dst / "config.pbtxt")
            if pinned.backend != backend or pinned.platform:
                raise RuntimeError(f"{dst / 'config.pbtxt'}: pinning to {backend} failed")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def served_workloads(args: argparse.Namespace) -> Iterator[tuple[list[Workload], Path]]:
    """The workloads of --models, their sample models prepared in --model-repository, and the
    repository served for --backend (see bench_repository)."""
    works = chosen_workloads(args)
    prepare_samples(args.model_repository, works)
    with bench_repository(args.backend, [w.model for w in works], args.model_repository) as repository:
        yield works, repository


@functools.lru_cache(maxsize=1)
def plan_selector() -> Any:
    """The selector the server builds (edgeserve.hardware.selector.PlanSelector over load_settings():
    the same settings file-less defaults and EDGESERVE_* environment as `edgeserve run` here)."""
    from edgeserve.config import load_settings
    from edgeserve.hardware.selector import PlanSelector

    return PlanSelector(load_settings())


class _Pool:
    """Instances shared by caller threads: a free one is handed out most recently used first (its
    threads and caches are warm, as with one client on the server); waiting callers are served first
    come, first served (a plain queue.Queue lets one thread win again and again: seconds of p99)."""

    def __init__(self, items: list[Any]) -> None:
        self._free = list(items)
        self._waiters: collections.deque[tuple[list[Any], threading.Event]] = collections.deque()
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        with self._lock:
            if self._free and not self._waiters:
                return self._free.pop()
            slot: list[Any] = []
            waiter = (slot, threading.Event())
            self._waiters.append(waiter)
        waiter[1].wait()
        return slot[0]

    def release(self, item: Any) -> None:
        with self._lock:
            if self._waiters:
                slot, event = self._waiters.popleft()
                slot.append(item)
                event.set()
            else:
                self._free.append(item)


class InProcess:
    """The model's runtime called in this process, as the server runs it: edgeserve's backend instances
    (thin wrappers over `InferenceSession.run` / an OpenVINO infer request), built from the same choice
    `edgeserve run` makes for this config (PlanSelector: backend, precision, threads, parameters), as
    many as its instance_group asks. Caller threads share them, one call per instance at a time (as the
    server's workers do), so both sides have the same instances and threads to work with.

    `parameters` are added to the config first: `matching` passes what the server decided at load (the
    ONNX Runtime thread probe) so that both sides run the same choice."""

    def __init__(
        self, repository: Path, model: str, parameters: Mapping[str, str] | None = None, instances: int = 0
    ) -> None:
        from edgeserve.backends.base import get_backend
        from edgeserve.repository.autocomplete import instance_count

        model_dir = repository / model
        config = read_config(model_dir / "config.pbtxt")
        if not config.name:
            config.name = model
        for key, value in (parameters or {}).items():
            config.parameters[key].string_value = value
        if instances:  # the server's layout: the in-process side races nothing of its own
            del config.instance_group[:]
            config.instance_group.add(count=instances)
        version_dir = max((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                          key=lambda p: int(p.name))  # fmt: skip
        choice = plan_selector().choose(model, model_dir, version_dir, config)
        backend = get_backend(choice.backend_name)
        self.backend = choice.backend_name
        self.options = choice.options
        self.model_path = choice.model_path
        self.instances = [backend.load(choice.model_path, config, choice.options)
                          for _ in range(instance_count(config))]  # fmt: skip
        self._pool = _Pool(self.instances)

    @staticmethod
    def wait_final(http_base: str, models: Sequence[str], timeout: float = 300.0) -> None:
        """Until the server's plan for each model is final (its background race ended; a device that
        restarts serves that from the cache at once): the steady state is what is compared. The race
        shares the CPU with requests while it runs, so a measurement during it times the race too.
        Only for a server started with the background race on (es_server turns it off)."""
        deadline = time.monotonic() + timeout
        waiting = list(models)
        while waiting:
            url = f"{http_base}/v2/models/{waiting[0]}/config"
            with urllib.request.urlopen(url, timeout=30) as response:
                params = json.loads(response.read()).get("parameters") or {}
            if params.get("runtime_choice_final", {}).get("string_value", "true") == "true":
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise SystemExit(f"{waiting[0]}: the server's plan is not final after {timeout:.0f} s")
            progress(f"{waiting[0]}: waiting for the plan's background race to end "
                     f"({deadline - time.monotonic():.0f} s left)")  # fmt: skip
            time.sleep(5)

    @classmethod
    def matching(cls, repository: Path, model: str, http_base: str) -> InProcess:
        """The in-process side of a running edgeserve's `model`: same backend (checked) and the
        parameters and layout it serves (instances x `intra_op_thread_count`, its served config)."""
        with urllib.request.urlopen(f"{http_base}/v2/models/{model}/config", timeout=30) as response:
            served = json.loads(response.read())
        params = {k: v.get("string_value", "") for k, v in (served.get("parameters") or {}).items()}
        tuned = {k: v for k, v in params.items() if k == "intra_op_thread_count"}
        instances = sum(max(int(g.get("count", 1)), 1) for g in served.get("instance_group") or []) or 1
        inproc = cls(repository, model, tuned, instances)
        if served.get("backend", "") != inproc.backend:
            inproc.close()
            raise SystemExit(f"{model}: edgeserve runs {served.get('backend')}, the in-process side "
                             f"{inproc.backend}")  # fmt: skip
        return inproc

    @property
    def label(self) -> str:
        threads = getattr(self.instances[0], "threads", 0) if self.instances else 0
        return (f"{self.backend} {self.options.precision}, {len(self.instances)} instance(s) x "
                f"{threads or self.options.threads} thread(s)")  # fmt: skip

    def infer(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        instance = self._pool.acquire()
        try:
            result: dict[str, Any] = instance.infer(feed)
            return result
        finally:
            self._pool.release(instance)

    def close(self) -> None:
        for instance in self.instances:
            instance.close()


def cpu_flags(wanted: Sequence[str]) -> str:
    """`wanted` as this CPU has them: "avx2 -amx_tile ..." ("-x": absent; x86 flags, ARM Features)."""
    from edgeserve.bench.int8 import cpu_flags as flag_set

    have = flag_set()
    return " ".join(f if f in have else f"-{f}" for f in wanted)


def machine_facts() -> str:
    """One line for the report: CPU, what it has for bf16, load, runtimes, date."""
    model, flags = platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    bf16 = ", ".join(f for f in wanted if f in flags) or "no AVX-512"
    if "amx_tile" not in flags:
        bf16 += ", no AMX"
    versions = [f"Python {platform.python_version()}"]
    for name in ("onnxruntime", "openvino"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{name} {importlib.metadata.version(name)}")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} vCPU {model} ({bf16}); "
            f"{'; '.join(versions)}; load average {load}")  # fmt: skip
