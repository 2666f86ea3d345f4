"""The sample appliance's memory (issue 26, item 2): `edgeserve run` on models/, per process, after
warm-up and after N minutes of mixed traffic on every model and every transport.

    python benchmarks/bench_memory.py                          # 10 minutes of traffic
    python benchmarks/bench_memory.py --minutes 2 --warmup 30  # while developing
    python benchmarks/bench_memory.py --env EDGESERVE_RUNTIME_MEMORY_PROFILE=standard   # A/B a setting

What it does:

1. Priming start (unless --no-prime): the appliance starts once on a state folder and stops, so the
   load-time runtime race is cached there, as on a device after its first boot. The measured start
   uses the same state folder (--state-dir keeps it between runs).
2. Measured start, READY=1, then `--warmup` seconds of the traffic below, `--idle` seconds idle (default 5;
   the standard profile releases OpenVINO's buffers after 10 s idle): the first table.
3. `--minutes` of the traffic, a sample of every process's RSS each `--sample` seconds (progress
   lines; the peak of the total is kept), `--idle` seconds idle: the second table.
4. The server's own breakdown (`edgeserve models list`: per process and per model) at the end.

Traffic (threads in this process, each paced to its rate, bounded by count and time, loopback only):
the OCR ensemble on camera-like frames of four sizes with 1-5 random text lines (ZeroMQ with the frame
in a shared-memory ring slot, gRPC unary, HTTP binary), mlp (HTTP, gRPC, ZeroMQ), accumulate
(sequences of 4 on a gRPC stream), ppocr_det / ppocr_cls / ppocr_rec called directly with the shapes
the pipeline makes (HTTP, ZeroMQ, gRPC), and ocr_pre (a Python model) directly over gRPC.

Tables: RSS, PSS and USS per process (supervisor, server, each Python worker) and their totals. The
target (under 350 MB) is on the total RSS, which counts shared library pages once per process; PSS
shares them out and is the honest sum. Machine facts (CPU flags) on the first line, the load
generator's own CPU share at the end. Stops only the processes it started, by their process id.
JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from bench_appliance import RESULTS, Appliance, code_version, start_appliance
from common import ROOT, bench_parser, cpu_flags, machine_facts, progress

MB = 1024 * 1024
TARGET_MB = 350.0
FRAME_SIZES = ((640, 480), (1280, 720), (800, 600), (1024, 768))
WORDS = ("EDGESERVE", "Gate", "Bay", "Lot", "A4", "kg", "2026", "Dock", "North", "exit", "12.5",
         "PALLET", "route", "B7", "Zone", "cargo", "ID", "0042", "check", "OK")  # fmt: skip


# -- inputs -------------------------------------------------------------------------------------------
def frame(width: int, height: int, rng: random.Random) -> np.ndarray:
    """A camera-like frame: a grey gradient, 1-5 lines of random words, a little noise."""
    from PIL import Image, ImageDraw, ImageFont

    ys, xs = np.mgrid[0:height, 0:width]
    base = (200 + 40 * xs / width - 30 * ys / height).astype(np.uint8)
    image = Image.fromarray(np.stack([base, base, base], -1))
    draw = ImageDraw.Draw(image)
    lines = rng.randint(1, 5)
    for i in range(lines):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        font = ImageFont.load_default(size=rng.randint(max(16, height // 24), max(24, height // 10)))
        draw.text((rng.randint(0, width // 4), (i + 0.3) * height / (lines + 0.5)), text, fill=(20, 20, 20),
                  font=font)  # fmt: skip
    noise = np.random.default_rng(rng.randint(0, 1 << 30)).integers(-6, 7, (height, width, 3))
    out: np.ndarray = np.clip(np.asarray(image).astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return out


def frames(count: int, seed: int = 26) -> list[np.ndarray]:
    rng = random.Random(seed)
    return [frame(*FRAME_SIZES[i % len(FRAME_SIZES)], rng) for i in range(count)]


# -- processes ----------------------------------------------------------------------------------------
def process_table(app: Appliance) -> list[dict[str, Any]]:
    """One row per process of the appliance: role, pid, RSS/PSS/USS in MB."""
    rows: list[dict[str, Any]] = []
    try:
        supervisor = psutil.Process(app.pid)
        members = [supervisor, *supervisor.children(recursive=True)]
    except psutil.Error:
        return rows
    for process in members:
        try:
            info = process.memory_full_info()
            cmd = process.cmdline()
        except psutil.Error:
            continue
        if process.pid == app.pid:
            role = "supervisor"
        elif "edgeserve.backends.python.worker" in cmd:
            label = cmd[cmd.index("--label") + 1] if "--label" in cmd else ""
            role = f"python worker: {label}"
        else:
            role = "server"
        rows.append({"role": role, "pid": process.pid, "rss_mb": info.rss / MB,
                     "pss_mb": getattr(info, "pss", 0) / MB, "uss_mb": info.uss / MB})  # fmt: skip
    return rows


FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "asimddp")


def total(rows: list[dict[str, Any]], key: str) -> float:
    return float(sum(r[key] for r in rows))


def quick_total_rss(app: Appliance) -> float:
    with contextlib.suppress(psutil.Error):
        supervisor = psutil.Process(app.pid)
        values: list[int] = []
        for process in [supervisor, *supervisor.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                values.append(process.memory_info().rss)
        return sum(values) / MB
    return float("nan")


# -- traffic ------------------------------------------------------------------------------------------
@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, error: BaseException | None) -> None:
        with self.lock:
            if error is None:
                self.ok += 1
                return
            self.errors += 1
            if not self.first_error:
                self.first_error = f"{type(error).__name__}: {str(error)[:300]}"


@dataclass
class Client:
    name: str
    rate: float  # calls per second
    make: Callable[[], Any]
    call: Callable[[Any, random.Random], None]
    close: Callable[[Any], None] = lambda _: None


def run_client(client: Client, tally: Tally, deadline: float, stop: threading.Event, seed: int) -> None:
    """Paced calls until the deadline (or `stop`); a failing connection is rebuilt after 3 errors."""
    rng = random.Random(seed)
    interval = 1.0 / client.rate
    due = time.monotonic()
    handle: Any = None
    failures = 0
    max_calls = int(client.rate * (deadline - time.monotonic()) * 2) + 10
    for _ in range(max_calls):
        now = time.monotonic()
        if now >= deadline or stop.is_set():
            break
        if due > now and stop.wait(due - now):
            break
        due = max(due + interval, time.monotonic())
        try:
            if handle is None:
                handle = client.make()
            client.call(handle, rng)
        except Exception as exc:
            tally.add(exc)
            failures += 1
            if failures >= 3 and handle is not None:
                with contextlib.suppress(Exception):
                    client.close(handle)
                handle, failures = None, 0
            continue
        failures = 0
        tally.add(None)
    if handle is not None:
        with contextlib.suppress(Exception):
            client.close(handle)


def make_clients(app: Appliance, pool: list[np.ndarray], scale: float) -> list[Client]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from edgeserve.client import ZmqClient

    grpc_url, http_url = f"127.0.0.1:{app.grpc_port}", f"127.0.0.1:{app.http_port}"
    ring_size = max(f.nbytes for f in pool)

    def g_in(name: str, array: np.ndarray, datatype: str) -> Any:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def h_in(name: str, array: np.ndarray, datatype: str) -> Any:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        return tensor

    def texts(result: Any) -> None:
        out = result.as_numpy("TEXT")
        if out is None or out.ndim != 1:
            raise RuntimeError("ocr: no TEXT")

    class Zmq:
        def __init__(self) -> None:
            self.client = ZmqClient(app.zmq_endpoint, timeout=60.0)
            self.ring = self.client.create_ring(4, ring_size)

        def close(self) -> None:
            self.ring.close()
            self.client.close()

    def ocr_zmq(z: Zmq, rng: random.Random) -> None:
        image = rng.choice(pool)
        slot = z.client.acquire_slot(z.ring)
        texts(z.client.infer("ocr", {"IMAGE": slot.write(image)}, ["TEXT"]))

    def ocr_grpc(c: Any, rng: random.Random) -> None:
        texts(c.infer("ocr", [g_in("IMAGE", rng.choice(pool), "UINT8")], client_timeout=60))

    def ocr_http(c: Any, rng: random.Random) -> None:
        texts(c.infer("ocr", [h_in("IMAGE", rng.choice(pool), "UINT8")]))

    def mlp_x(rng: random.Random) -> np.ndarray:
        return np.random.default_rng(rng.randint(0, 1 << 30)).random(
            (rng.randint(1, 4), 16), dtype=np.float32
        )

    def mlp_http(c: Any, rng: random.Random) -> None:
        c.infer("mlp", [h_in("INPUT0", mlp_x(rng), "FP32")]).as_numpy("OUTPUT0")

    def mlp_grpc(c: Any, rng: random.Random) -> None:
        c.infer("mlp", [g_in("INPUT0", mlp_x(rng), "FP32")], client_timeout=30).as_numpy("OUTPUT0")

    def mlp_zmq(z: Any, rng: random.Random) -> None:
        z.infer("mlp", {"INPUT0": mlp_x(rng)}).as_numpy("OUTPUT0")

    class Stream:
        def __init__(self) -> None:
            self.client = grpcclient.InferenceServerClient(grpc_url)
            self.replies: queue.Queue[tuple[Any, Any]] = queue.Queue()
            self.client.start_stream(callback=lambda result, error: self.replies.put((result, error)))
            self.next_id = 1000

        def close(self) -> None:
            with contextlib.suppress(Exception):
                self.client.stop_stream()
            self.client.close()

    def accumulate(s: Stream, rng: random.Random) -> None:
        s.next_id += 1
        expected = 0.0
        for step in range(4):
            value = float(rng.randint(1, 9))
            expected += value
            inputs = [g_in("INPUT", np.array([[value]], np.float32), "FP32")]
            s.client.async_stream_infer("accumulate", inputs,
                                        sequence_id=s.next_id, sequence_start=step == 0,
                                        sequence_end=step == 3)  # fmt: skip
            result, error = s.replies.get(timeout=30)
            if error is not None:
                raise RuntimeError(f"accumulate: {error}")
            if float(result.as_numpy("OUTPUT").ravel()[0]) != expected:
                raise RuntimeError("accumulate: wrong running sum")

    det_shapes = ((480, 640), (544, 960), (608, 800), (736, 960))

    def det_http(c: Any, rng: random.Random) -> None:
        h, w = rng.choice(det_shapes)
        x = np.random.default_rng(rng.randint(0, 1 << 30)).random((1, 3, h, w), dtype=np.float32)
        c.infer("ppocr_det", [h_in("x", x, "FP32")])

    def cls_zmq(z: Any, rng: random.Random) -> None:
        x = np.random.default_rng(rng.randint(0, 1 << 30)).random((rng.randint(1, 8), 3, 48, 192), np.float32)
        z.infer("ppocr_cls", {"x": x})

    def rec_grpc(c: Any, rng: random.Random) -> None:
        shape = (rng.randint(1, 8), 3, 48, rng.randrange(48, 800, 8))
        x = np.random.default_rng(rng.randint(0, 1 << 30)).random(shape, dtype=np.float32)
        c.infer("ppocr_rec", [g_in("x", x, "FP32")], client_timeout=60)

    def pre_grpc(c: Any, rng: random.Random) -> None:
        c.infer("ocr_pre", [g_in("IMAGE", rng.choice(pool), "UINT8")], client_timeout=60)

    def grpc_make() -> Any:
        return grpcclient.InferenceServerClient(grpc_url)

    def http_make() -> Any:
        return httpclient.InferenceServerClient(http_url, connection_timeout=60, network_timeout=60)

    def zmq_make() -> Any:
        return ZmqClient(app.zmq_endpoint, timeout=60.0)

    def close(c: Any) -> None:
        c.close()

    return [
        Client("ocr zmq+ring", 0.8 * scale, Zmq, ocr_zmq, lambda z: z.close()),
        Client("ocr grpc", 0.8 * scale, grpc_make, ocr_grpc, close),
        Client("ocr http", 0.4 * scale, http_make, ocr_http, close),
        Client("mlp http", 10 * scale, http_make, mlp_http, close),
        Client("mlp grpc", 10 * scale, grpc_make, mlp_grpc, close),
        Client("mlp zmq", 10 * scale, zmq_make, mlp_zmq, close),
        Client("accumulate grpc-stream", 2 * scale, Stream, accumulate, lambda s: s.close()),
        Client("ppocr_det http", 0.3 * scale, http_make, det_http, close),
        Client("ppocr_cls zmq", 2 * scale, zmq_make, cls_zmq, close),
        Client("ppocr_rec grpc", 1 * scale, grpc_make, rec_grpc, close),
        Client("ocr_pre grpc", 0.5 * scale, grpc_make, pre_grpc, close),
    ]


def traffic(app: Appliance, clients: list[Client], seconds: float, tallies: dict[str, Tally],
            sample_s: float, label: str) -> list[tuple[float, float]]:  # fmt: skip
    """Run every client for `seconds`; sample the total RSS every `sample_s` (progress lines)."""
    deadline = time.monotonic() + seconds
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=run_client,
            args=(c, tallies[c.name], deadline, stop, i),
            daemon=True,
            name=f"bench-{c.name}",
        )
        for i, c in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    try:
        while time.monotonic() < deadline:
            time.sleep(min(sample_s, max(0.0, deadline - time.monotonic())))
            rss = quick_total_rss(app)
            samples.append((time.monotonic() - t0, rss))
            done = sum(t.ok for t in tallies.values())
            errors = sum(t.errors for t in tallies.values())
            progress(f"{label}: {time.monotonic() - t0:5.0f}/{seconds:.0f} s, total RSS {rss:6.1f} MB, "
                     f"{done} calls, {errors} errors")  # fmt: skip
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    return samples


# -- report -------------------------------------------------------------------------------------------
def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"**{title}**", "", "| process | pid | RSS MB | PSS MB | USS MB |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['role']} | {r['pid']} | {r['rss_mb']:.1f} | {r['pss_mb']:.1f} | {r['uss_mb']:.1f} |"
        )
    rss, pss, uss = total(rows, "rss_mb"), total(rows, "pss_mb"), total(rows, "uss_mb")
    verdict = "under" if rss < TARGET_MB else "OVER"
    lines.append(
        f"| **total** ({verdict} the {TARGET_MB:.0f} MB target) | | **{rss:.1f}** | {pss:.1f} | {uss:.1f} |"
    )
    return "\n".join(lines)


def breakdown(app: Appliance) -> str:
    """`edgeserve models list` against the running appliance (its per-process and per-model memory)."""
    command = [
        sys.executable,
        "-m",
        "edgeserve",
        "models",
        "list",
        "--url",
        f"http://127.0.0.1:{app.http_port}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(edgeserve models list failed: {exc})"
    return done.stdout + (done.stderr if done.returncode else "")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic after warm-up (default 10)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of warm-up traffic (default 60)")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between RSS samples (default 30)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle before a table (default 5)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every client's rate")
    parser.add_argument("--repository", type=Path, default=ROOT / "models")
    parser.add_argument("--state-dir", type=Path, help="kept between runs (default: a temporary folder)")
    parser.add_argument("--no-prime", action="store_true", help="measure a first start (runtime races)")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the appliance (repeatable)"
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="es-mem-state-"))
    state.mkdir(parents=True, exist_ok=True)
    env["EDGESERVE_SERVER_STATE_DIR"] = str(state)
    facts = f"{machine_facts()}; CPU flags: {cpu_flags(FLAGS)}"
    progress(f"{facts}; edgeserve at {code_version()}; env {args.env or 'default'}")
    pool = frames(12)
    if not args.no_prime:
        progress("priming start (fills the runtime race cache in the state folder)")
        app = start_appliance(args.repository, [], env=env)
        try:
            app.wait_ready(900)
        finally:
            app.stop()
            shutil.rmtree(app.tmp, ignore_errors=True)
    app = start_appliance(args.repository, [], env=env)
    result: dict[str, Any] = {"facts": facts, "code": code_version(), "env": args.env, "args": vars(args)}
    me = psutil.Process()
    try:
        ready_s = app.wait_ready(900)
        progress(f"READY=1 after {ready_s:.1f} s; supervisor {app.pid}, server {app.server_pid()}")
        tallies: dict[str, Tally] = {}
        clients = make_clients(app, pool, args.scale)
        for c in clients:
            tallies[c.name] = Tally()
        time.sleep(5)
        result["ready"] = process_table(app)
        traffic(app, clients, args.warmup, tallies, args.sample, "warm-up")
        time.sleep(args.idle)
        result["warm"] = process_table(app)
        progress(f"after warm-up: total RSS {total(result['warm'], 'rss_mb'):.1f} MB")
        cpu0, t0 = me.cpu_times(), time.monotonic()
        samples = traffic(app, clients, args.minutes * 60, tallies, args.sample, "traffic")
        cpu1, wall = me.cpu_times(), time.monotonic() - t0
        time.sleep(args.idle)
        result["after"] = process_table(app)
        result["samples"] = samples
        result["load_cpu_share"] = (
            100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (wall * (os.cpu_count() or 1))
        )
        result["tallies"] = {n: {"ok": t.ok, "errors": t.errors, "first_error": t.first_error}
                             for n, t in tallies.items()}  # fmt: skip
        result["breakdown"] = breakdown(app)
    finally:
        code, _ = app.stop()
        result["exit_code"] = code
        if code != 0:
            progress(app.log()[-3000:])
        shutil.rmtree(app.tmp, ignore_errors=True)
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    print(report(result, args))
    progress(f"wrote {out}")
    return 0


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    peak = max((rss for _, rss in result.get("samples", [])), default=float("nan"))
    calls = ", ".join(
        f"{n} {t['ok']}" + (f" ({t['errors']} errors: {t['first_error']})" if t["errors"] else "")
        for n, t in result.get("tallies", {}).items()
    )
    parts = [
        f"Machine: {result['facts']}",
        f"edgeserve at {result['code']}; appliance environment: {' '.join(args.env) or '(defaults)'}",
        "",
        table("After READY=1 (5 s idle)", result["ready"]),
        "",
        table(f"After warm-up ({args.warmup:.0f} s of traffic, {args.idle:g} s idle)", result["warm"]),
        "",
        table(f"After {args.minutes:g} minutes of mixed traffic ({args.idle:g} s idle)", result["after"]),
        "",
        f"Peak total RSS sampled during the traffic (every {args.sample:g} s): {peak:.1f} MB",
        f"Calls: {calls}",
        f"Load generator CPU share (this process, of all cores): {result['load_cpu_share']:.0f}%",
        "",
        "`edgeserve models list` at the end:",
        "",
        "```",
        result.get("breakdown", "").rstrip(),
        "```",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
