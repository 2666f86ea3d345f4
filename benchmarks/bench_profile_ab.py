"""The price of each memory-profile knob (issue 36): one edgeserve server per variant, all on the same
models (ONNX Runtime pinned, open_nsfw and the MLP by default), measured round after round with the
variants' order rotated and the servers not measured paused (SIGSTOP), as bench_ab.py does; then each
server's RSS (with its children). A variant is "name:KEY=VALUE,..." where KEY is

    param.NAME      a config.pbtxt parameter of every model (ort_memory_arena, ort_memory_pattern ...)
    profile.FIELD   a field of the `standard` profile (backends/memory.py; 0 for a glibc knob = glibc's
                    own default), patched in the server process by a sitecustomize on PYTHONPATH
    ENV_NAME        an environment variable of the server (EDGESERVE_*, MALLOC_*)

    python benchmarks/bench_profile_ab.py --variant now: --variant arena:param.ort_memory_arena=true \\
        --variant glibc:profile.malloc_arena_max=0,profile.server_mmap_threshold=0 --rounds 4

`--in-process BATCH`: instead, ONNX Runtime's arena and memory pattern and glibc's mmap threshold
(4 MB fixed, as `standard` had, or 32 MB, glibc's dynamic ceiling) on open_nsfw in this process, one
session per variant, blocks of calls interleaved: CPU time per image, page faults and system CPU.

Prints every round (stderr), then per model and transport the median req/s and p50 with the ratio to
the first variant and how many rounds it was at or above it, the server's CPU time per request
(user + system, children included: steadier than req/s on a loaded box) with its ratio, its minor
page faults per request, and the RSS.
Only the servers started here are stopped.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ab import addresses, drive
from bench_peers import Side
from bench_plan import fetch_nsfw
from common import ROOT, WORKLOADS, Workload, bench_parser, machine_facts, progress
from es_server import start_server

NSFW = Workload("open_nsfw", "input:0", "outputs", (1, 224, 224, 3), 5_000)
SITECUSTOMIZE = """import os
_patch = os.environ.get("EDGESERVE_BENCH_PROFILE_PATCH")
if _patch:
    import dataclasses
    from edgeserve.backends import memory
    _fields = dict(item.split("=", 1) for item in _patch.split(","))
    memory.STANDARD = dataclasses.replace(
        memory.STANDARD, **{k: (float(v) if "." in v else int(v)) for k, v in _fields.items()})
"""
NSFW_CONFIG = """name: "open_nsfw"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "input:0", data_type: TYPE_FP32, dims: [ 224, 224, 3 ] } ]
output [ { name: "outputs", data_type: TYPE_FP32, dims: [ 2 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


def parse_variant(text: str) -> tuple[str, dict[str, str], dict[str, str], dict[str, str]]:
    """(name, environment, model parameters, profile fields)."""
    name, _, items = text.partition(":")
    env: dict[str, str] = {}
    params: dict[str, str] = {}
    fields: dict[str, str] = {}
    for item in filter(None, items.split(",")):
        key, _, value = item.partition("=")
        if key.startswith("param."):
            params[key[6:]] = value
        elif key.startswith("profile."):
            fields[key[8:]] = value
        elif key.startswith(("EDGESERVE_", "MALLOC_")):
            env[key] = value
        else:
            raise SystemExit(
                f"--variant {text!r}: {key!r} is not param.*, profile.*, EDGESERVE_* or MALLOC_*"
            )
    return name, env, params, fields


def repository(folder: Path, models: list[str], params: dict[str, str]) -> Path:
    """A repository of `models` pinned to ONNX Runtime, every model given `params`."""
    extra = "".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()
    )
    for model in models:
        dst = folder / model / "1"
        dst.mkdir(parents=True)
        if model == "open_nsfw":
            (dst / "model.onnx").symlink_to(
                fetch_nsfw(Path.home() / ".cache/edgeserve-bench") / "1/model.onnx"
            )
            config = NSFW_CONFIG
        else:
            src = ROOT / "models" / model
            (dst / "model.onnx").symlink_to(src / "1" / "model.onnx")
            lines = (src / "config.pbtxt").read_text().splitlines()
            config = "\n".join(x for x in lines if not x.startswith(("backend:", "platform:")))
            config += '\nbackend: "onnxruntime"\n'
        (folder / model / "config.pbtxt").write_text(config + extra)
    return folder


def cpu_s(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and minor page faults of the server and its children so far."""
    proc = psutil.Process(pid)
    tree = [proc, *proc.children(recursive=True)]
    faults = 0
    for p in tree:
        with open(f"/proc/{p.pid}/stat", encoding="ascii") as fh:
            faults += int(fh.read().rpartition(")")[2].split()[7])  # minflt, counted not timed
    return sum(sum(p.cpu_times()[:2]) for p in tree), faults


def rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return float(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])) / 2**20


def in_process(batch: int, rounds: int) -> None:
    """The runtime's knobs alone, in this process (no server, no clients): CPU per image is steadier
    than wall time on a loaded box, and page faults are counted, not timed."""
    import ctypes
    import resource

    import onnxruntime as ort

    libc = ctypes.CDLL("libc.so.6")
    path = fetch_nsfw(Path.home() / ".cache/edgeserve-bench") / "1/model.onnx"
    variants = {
        "arena off, 4 MB": (False, False, 4 << 20),
        "arena on, 4 MB": (True, False, 4 << 20),
        "arena off, 32 MB": (False, False, 32 << 20),
        "pattern on, 4 MB": (False, True, 4 << 20),
    }
    sessions = {}
    for name, (arena, pattern, _) in variants.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
        so.enable_cpu_mem_arena, so.enable_mem_pattern = arena, pattern
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    x = {"input:0": np.random.default_rng(0).random((batch, 224, 224, 3), dtype=np.float32)}
    got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    for rnd in range(rounds):
        names = list(variants)[rnd % len(variants) :] + list(variants)[: rnd % len(variants)]
        for name in names:
            threshold = variants[name][2]
            libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (fixed: glibc's dynamic one stops here)
            libc.mallopt(-1, 2 * threshold)  # M_TRIM_THRESHOLD
            sessions[name].run(None, x)
            calls = max(3, 24 // batch)
            t0, u0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(calls):
                sessions[name].run(None, x)
            t1, u1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            per = calls * batch
            got[name].append(((t1 - t0) * 1e3 / per, (u1.ru_minflt - u0.ru_minflt) / calls,
                              (u1.ru_stime - u0.ru_stime) * 1e3 / per))  # fmt: skip
        progress(f"round {rnd + 1}/{rounds}: " + ", ".join(f"{n} {got[n][-1][0]:.1f}" for n in variants)
                 + f" CPU ms/image; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    base = statistics.median(g[0] for g in got["arena off, 4 MB"])
    print(f"\nopen_nsfw in-process, batch {batch}, {rounds} rounds; median CPU ms per image (speed vs "
          "'arena off, 4 MB'), page faults per call, system CPU ms per image\n")  # fmt: skip
    print("| variant | CPU ms/image | speed | faults/call | sys ms/image |\n|---|--:|--:|--:|--:|")
    for name in variants:
        cpu = statistics.median(g[0] for g in got[name])
        faults = statistics.median(g[1] for g in got[name])
        sys_ms = statistics.median(g[2] for g in got[name])
        print(f"| {name} | {cpu:.1f} | {base / cpu:.3f} | {faults:,.0f} | {sys_ms:.2f} |")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--in-process", type=int, metavar="BATCH", help="the runtime's knobs alone")
    parser.add_argument("--models", default="open_nsfw,mlp")
    parser.add_argument("--transports", default="gRPC unary,HTTP")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (finally) on kill
    if args.in_process:
        print(machine_facts(), flush=True)
        in_process(args.in_process, args.rounds)
        return 0
    variants = [parse_variant(v) for v in args.variant]
    if len(variants) < 2 or len({v[0] for v in variants}) != len(variants):
        raise SystemExit("give at least two --variant, with different names (or --in-process BATCH)")
    models = [m for m in args.models.split(",") if m]
    works = {m: NSFW if m == "open_nsfw" else WORKLOADS[m] for m in models}
    transports = [t for t in args.transports.split(",") if t]
    tmp = Path(tempfile.mkdtemp(prefix="bench-profile-ab-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    print(machine_facts(), flush=True)
    sides: list[Side] = []
    try:
        for name, env, params, fields in variants:
            progress(f"starting '{name}' env={env} params={params} profile={fields}")
            folder = tmp / name
            repo = repository(folder / "models", models, params)
            env = {**env, "PYTHONPATH": str(tmp / "site")}
            if fields:
                env["EDGESERVE_BENCH_PROFILE_PATCH"] = ",".join(f"{k}={v}" for k, v in fields.items())
            env["EDGESERVE_RUNTIME_MEMORY_PROFILE"] = "standard"
            flags = ["--host", "127.0.0.1", "--log-level", "WARNING"]
            flags += [x for m in models for x in ("--load-model", m)]
            server = start_server(repo, folder, env=env, timeout=300, args=flags)
            sides.append(Side(name, server.process.pid, addresses(server), server.stop))
        rates: dict[tuple[str, str, str], list[tuple[float, float, float, float]]] = {}
        loads: list[float] = []
        for rnd in range(args.rounds):
            shift = rnd % len(sides)
            loads.append(os.getloadavg()[0])
            for model, work in works.items():
                x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
                for transport in transports:
                    for side in sides[shift:] + sides[:shift]:
                        for other in sides:
                            other.resume() if other is side else other.pause()
                        address = side.addresses[transport]
                        drive(address, transport, work, x, args.clients, args.warmup)
                        before = cpu_s(side.pid)
                        r = drive(address, transport, work, x, args.clients, args.seconds)
                        after = cpu_s(side.pid)
                        cpu_ms = (after[0] - before[0]) * 1e3 / max(1, len(r.latencies_s))
                        faults = (after[1] - before[1]) / max(1, len(r.latencies_s))
                        cell = (r.throughput, r.p50_ms, cpu_ms, faults)
                        rates.setdefault((model, transport, side.name), []).append(cell)
                        progress(f"round {rnd + 1}/{args.rounds} {model} {transport} {side.name}: "
                                 f"{r.throughput:,.1f}/s p50 {r.p50_ms:.2f} ms, CPU {cpu_ms:.2f} ms/req, "
                                 f"{faults:.0f} faults/req, "
                                 f"errors {r.errors}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
        for side in sides:
            side.resume()
        base = sides[0].name
        print(f"\n{args.clients} clients, {args.rounds} rounds of {args.seconds:g} s, load average (1 min) "
              f"per round {', '.join(f'{v:.1f}' for v in loads)}; median req/s and p50 ms, ratio to "
              f"'{base}' (rounds at or above it)\n")  # fmt: skip
        print("| model | transport | " + " | ".join(s.name for s in sides) + " |")
        print("|---|---|" + "--:|" * len(sides))
        for model in works:
            for transport in transports:
                first = rates[(model, transport, base)]
                cells = []
                for side in sides:
                    mine = rates[(model, transport, side.name)]
                    rate = statistics.median(m[0] for m in mine)
                    p50 = statistics.median(m[1] for m in mine)
                    cpu = statistics.median(m[2] for m in mine)
                    ratio = rate / statistics.median(f[0] for f in first)
                    cpu_ratio = cpu / statistics.median(f[2] for f in first)
                    wins = sum(m[0] >= f[0] for m, f in zip(mine, first, strict=True))
                    extra = "" if side.name == base else f" ({ratio:.3f}; {wins}/{len(mine)})"
                    cpu_extra = "" if side.name == base else f" ({cpu_ratio:.3f})"
                    faults = statistics.median(m[3] for m in mine)
                    cells.append(f"{rate:,.1f}{extra}, p50 {p50:.1f} ms, CPU {cpu:.2f}{cpu_extra} ms/req, "
                                 f"{faults:,.0f} faults/req")  # fmt: skip
                print(f"| {model} | {transport} | " + " | ".join(cells) + " |")
        print("\n| RSS after the run (server + children) | " + " | ".join(s.name for s in sides) + " |")
        print("|---|" + "--:|" * len(sides))
        print("| MB | " + " | ".join(f"{rss_mb(s.pid):.0f}" for s in sides) + " |")
    finally:
        for side in sides:
            side.resume()
            side.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
