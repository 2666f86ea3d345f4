"""The local fast path, A/B between source trees, each client in its own process (as a camera client
is): a 600 KB FP32 frame copied into a ring slot with `Slot.write`, 4 KB out, one request in flight.

Every variant is a source tree (this one, ".", or another checkout, e.g. main's) with its own server
(`python -m edgeserve serve` run from that tree) and its own client process (PYTHONPATH = that tree,
benchmarks/fastpath_client.py), optionally with server settings (EDGESERVE_*) or the client's
`spin_us`. Round after round, the in-process call (the model as the server runs it, in a process of
its own) and every variant run back to back, the order rotated each round; the servers not being
measured are paused (SIGSTOP). The report gives p50/p99 per variant pooled over the rounds, the
median per round of "p50 above the in-process p50 of the same round", and the target check
(p50 under 0.25 ms above in-process).

    git archive main | (mkdir -p /tmp/es-main && tar -x -C /tmp/es-main)
    python benchmarks/bench_fastpath_ab.py --variant main=/tmp/es-main --variant new=. --rounds 8
    python benchmarks/bench_fastpath_ab.py --variant new=. --variant nospin=.:spin=0 \\
        --variant srvnospin=.:EDGESERVE_ZMQ_SPIN_US=0

Loopback only; every loop is bounded; only the processes started here are stopped, by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_local import CONFIG, build_model
from common import ROOT, PausedTree, bench_parser, cpu_flags, machine_facts, percentile, progress
from es_server import RunningServer, free_port, get_status, server_command
from fastpath_client import ctx_switches

CLIENT = Path(__file__).resolve().parent / "fastpath_client.py"
MODEL = "frame_pool"
TARGET_MS = 0.25
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8")


@dataclass
class Variant:
    name: str
    src: Path
    server_env: dict[str, str] = field(default_factory=dict)
    spin_us: int = -1
    server: RunningServer | None = None
    paused: PausedTree = field(default_factory=PausedTree)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.src)}

    def pause(self) -> None:
        if self.server is not None:
            self.paused.pause(self.server.process.pid)

    def resume(self) -> None:
        self.paused.resume()


def measure_only(variants: list[Variant], variant: Variant | None) -> None:
    """Pause every variant's server but `variant`'s (None: the in-process phase), resume that one."""
    for other in variants:
        if other is not variant:
            other.pause()
    if variant is not None:
        variant.resume()


@contextlib.contextmanager
def servers(
    variants: list[Variant], repo: Path, tmp: Path, flags: Sequence[str] = (), timeout: float = 240.0
) -> Iterator[None]:
    """Every variant's server started (and paused); resumed and stopped on the way out."""
    try:
        for variant in variants:
            progress(f"starting {variant.name}: {variant.src} {variant.server_env or ''}")
            variant.server = start_server(variant, repo, tmp, flags, timeout)
            variant.pause()
        yield
    finally:
        for variant in variants:
            variant.resume()
            if variant.server is not None:
                variant.server.stop()


def parse_variant(text: str) -> Variant:
    """name=SRC[:spin=N,EDGESERVE_KEY=VALUE,...]"""
    name, _, rest = text.partition("=")
    src, _, options = rest.partition(":")
    variant = Variant(name, (ROOT if src in ("", ".") else Path(src)).resolve())
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key == "spin":
            variant.spin_us = int(value)
        elif key.startswith("EDGESERVE_"):
            variant.server_env[key] = value
        else:
            raise SystemExit(f"--variant {text!r}: options are spin=N or EDGESERVE_KEY=VALUE")
    if not name or not (variant.src / "edgeserve" / "__init__.py").is_file():
        raise SystemExit(f"--variant {text!r}: expected name=SOURCE_TREE (a folder holding edgeserve/)")
    return variant


def start_server(
    variant: Variant, repo: Path, tmp: Path, flags: Sequence[str] = (), timeout: float = 240.0
) -> RunningServer:
    """`python -m edgeserve serve` run from the variant's tree (its cwd and PYTHONPATH)."""
    http_port, grpc_port = free_port(), free_port()
    endpoint = f"ipc://{tmp}/{variant.name}.zmq"
    log_path = tmp / f"server-{variant.name}.log"
    cmd = server_command("serve", repo, http_port, grpc_port, endpoint, ["--log-level", "WARNING", *flags])
    env = {**variant.env(), "EDGESERVE_SERVER_STATE_DIR": str(tmp / f"state-{variant.name}"),
           **variant.server_env}  # fmt: skip
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=variant.src)
    server = RunningServer(process, http_port, grpc_port, endpoint, log_path, repo, variant.server_env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{variant.name}: edgeserve exited:\n{server.log()}")
        if get_status(server.base + "/v2/health/ready") == 200:
            return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"{variant.name}: edgeserve not ready in {timeout:.0f} s:\n{server.log()}")


def served_parameters(variants: list[Variant]) -> dict[str, str]:
    """What the first server chose at load (the ONNX Runtime thread probe): the in-process side runs
    the same. Every variant must run the model on the same backend."""
    tuned: dict[str, str] = {}
    for variant in variants:
        assert variant.server is not None
        variant.resume()
        try:
            with urllib.request.urlopen(
                f"{variant.server.base}/v2/models/{MODEL}/config", timeout=30
            ) as answer:
                served = json.loads(answer.read())
        finally:
            variant.pause()
        if served.get("backend") != "onnxruntime":
            raise SystemExit(f"{variant.name}: serves {MODEL} on {served.get('backend')}, not onnxruntime")
        params = {k: v.get("string_value", "") for k, v in (served.get("parameters") or {}).items()}
        tuned = tuned or {k: v for k, v in params.items() if k == "intra_op_thread_count"}
    return tuned


def server_cpu(variant: Variant | None) -> float:
    """CPU seconds the variant's server has used so far (0 for the in-process phase)."""
    if variant is None or variant.server is None:
        return 0.0
    times = psutil.Process(variant.server.process.pid).cpu_times()
    return float(times.user + times.system)


def run_client(
    args: list[str], env: dict[str, str], seconds: float, variant: Variant | None = None
) -> dict[str, Any]:
    """One client process; adds the server's CPU per answered call over the client's whole life."""
    cpu0 = server_cpu(variant)
    server = variant.server if variant is not None else None
    ctx0 = ctx_switches(str(server.process.pid)) if server is not None else 0
    cmd = [sys.executable, str(CLIENT), "--seconds", str(seconds), "--start", str(time.time() + 3.0), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 180, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"client {args} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    result["server_cpu_us"] = 1e6 * (server_cpu(variant) - cpu0) / max(1, result["calls"])
    # the server's switches over the client's whole life (warm-up too), per call it answered
    ctx = ctx_switches(str(server.process.pid)) - ctx0 if server is not None else 0
    result["ctx_per_call"] = (result["ctx"] / max(1, len(result["latencies"])), ctx / max(1, result["calls"]))
    return result


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--variant", action="append", help="name=SOURCE_TREE[:spin=N,EDGESERVE_KEY=VALUE]")
    parser.add_argument("--mode", choices=("write", "inplace"), default="write")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["new=."]]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("give each --variant its own name")
    tmp = Path(tempfile.mkdtemp(prefix="es-fastpath-"))
    repo = tmp / "models"
    build_model(repo / MODEL / "1" / "model.onnx")
    (repo / MODEL / "config.pbtxt").write_text('backend: "onnxruntime"\n' + CONFIG)
    facts = f"{machine_facts()}; CPU flags: {cpu_flags(FLAGS)}"
    latencies: dict[str, list[list[float]]] = {v.name: [] for v in variants}
    latencies["inproc"] = []
    cpu: dict[str, list[float]] = {name: [] for name in latencies}
    cpu_us: dict[str, list[tuple[float, float]]] = {name: [] for name in latencies}  # client, server
    ctx: dict[str, list[tuple[float, float]]] = {name: [] for name in latencies}  # switches per call
    with servers(variants, repo, tmp):
        tuned = served_parameters(variants)
        checksums: dict[str, float] = {}
        names = ["inproc", *(v.name for v in variants)]
        for rnd in range(args.rounds):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                variant = next((v for v in variants if v.name == name), None)
                measure_only(variants, variant)
                if variant is None:
                    client = ["--mode", "inproc", "--repo", str(repo), "--params", json.dumps(tuned)]
                    result = run_client(client, {**os.environ, "PYTHONPATH": str(ROOT)}, args.seconds)
                else:
                    assert variant.server is not None
                    client = ["--mode", args.mode, "--endpoint", variant.server.zmq_endpoint,
                              "--slots", str(args.slots), "--spin-us", str(variant.spin_us)]  # fmt: skip
                    result = run_client(client, variant.env(), args.seconds, variant)
                latencies[name].append(result["latencies"])
                cpu[name].append(100.0 * result["cpu"] / max(result["wall"], 1e-9))
                cpu_us[name].append(
                    (1e6 * result["cpu"] / max(1, len(result["latencies"])), result["server_cpu_us"])
                )
                checksums[name] = result["checksum"]
                ctx[name].append(result["ctx_per_call"])
                p50 = percentile(result["latencies"], 50) * 1e3
                progress(
                    f"round {rnd + 1}/{args.rounds} {name}: p50 {p50:.3f} ms, {len(result['latencies'])} rt"
                )
        reference = checksums["inproc"]
        for name, value in checksums.items():
            if abs(value - reference) > 1e-3 * max(1.0, abs(reference)):
                raise SystemExit(f"{name}: output checksum {value} differs from in-process {reference}")
        report(args, variants, latencies, cpu, cpu_us, facts, tmp, ctx)
    return 0


def report(
    args: argparse.Namespace,
    variants: list[Variant],
    latencies: dict[str, list[list[float]]],
    cpu: dict[str, list[float]],
    cpu_us: dict[str, list[tuple[float, float]]],
    facts: str,
    tmp: Path,
    ctx: dict[str, list[tuple[float, float]]],
) -> None:
    inproc_p50 = [percentile(r, 50) * 1e3 for r in latencies["inproc"]]
    frame = "Slot.write per call" if args.mode == "write" else "frame in place"
    print(f"\n{facts}")
    print(f"frame_pool: 600 KB FP32 in ({frame}), 4 KB out; 1 client in its own process, one request in "
          f"flight; {args.rounds} rounds of {args.seconds:g} s, order rotated\n")  # fmt: skip
    print("| variant | calls | p50 ms | p99 ms | p50 above in-process (median of rounds) | per round "
          "| client CPU | CPU µs per call: client + server | context switches per call: client + server |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    for name in ["inproc", *(v.name for v in variants)]:
        pooled = [x for r in latencies[name] for x in r]
        per_round = [percentile(r, 50) * 1e3 for r in latencies[name]]
        added = [p - i for p, i in zip(per_round, inproc_p50, strict=True)]
        row = {
            "variant": name,
            "calls": len(pooled),
            "p50_ms": percentile(pooled, 50) * 1e3,
            "p99_ms": percentile(pooled, 99) * 1e3,
            "above_ms": statistics.median(added) if name != "inproc" else 0.0,
            "per_round_above_ms": added,
            "client_cpu_pct": statistics.mean(cpu[name]),
            "client_cpu_us": statistics.median(c for c, _ in cpu_us[name]),
            "server_cpu_us": statistics.median(s for _, s in cpu_us[name]),
            "client_ctx": statistics.median(c for c, _ in ctx[name]),
            "server_ctx": statistics.median(s for _, s in ctx[name]),
        }
        rows.append(row)
        above = "—" if name == "inproc" else f"{row['above_ms']:+.3f} ms"
        rounds = ", ".join(f"{a:+.3f}" for a in added) if name != "inproc" else ""
        work = f"{row['client_cpu_us']:.0f} + {row['server_cpu_us']:.0f}"
        switches = f"{row['client_ctx']:.1f} + {row['server_ctx']:.1f}"
        print(f"| {name} | {row['calls']:,} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | {above} | {rounds} "
              f"| {row['client_cpu_pct']:.0f}% | {work} | {switches} |")  # fmt: skip
    print()
    for row in rows[1:]:
        verdict = "PASS" if row["above_ms"] < TARGET_MS else "FAIL"
        print(f"target: {row['variant']} p50 above in-process {row['above_ms']:.3f} ms "
              f"(< {TARGET_MS} ms): {verdict}")  # fmt: skip
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"bench_fastpath_ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    described = {
        v.name: {"src": str(v.src), "server_env": v.server_env, "spin_us": v.spin_us} for v in variants
    }
    out.write_text(
        json.dumps({"args": vars(args), "machine": facts, "rows": rows, "variants": described}, indent=2)
    )
    progress(f"results: {out}; work folder {tmp}")


if __name__ == "__main__":
    sys.exit(main())
