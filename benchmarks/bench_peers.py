"""Side by side with the peers (issue 14), one script, one process tree, back to back: the same ONNX
models on the same runtime (ONNX Runtime, edgeserve's session options, same instance count), called

    in-process       edgeserve's ORT instance(s) called from N threads (the limit; common.InProcess)
    edgeserve        gRPC unary, gRPC stream, HTTP (binary tensors), ZeroMQ, ZeroMQ + shm (Slot.write)
    pytriton         a real tritonserver (nvidia-pytriton 0.7.0; benchmarks/pytriton_peer.py): gRPC
                     unary, gRPC stream, HTTP (binary tensors)
    mlserver         MLServer 1.7.1 with an ORT MLModel (mlserver_peer.py, mlserver_ort.py), adaptive
                     batching as edgeserve's dynamic batcher: gRPC unary, HTTP (JSON tensors)
    ray              Ray Serve 2.60.0, a deployment with @serve.batch (ray_peer.py) behind its HTTP
                     proxy: aiohttp with a V2-shaped JSON body, and with the raw float32 bytes

with the same N concurrent clients (tasks on one event loop in this process; peer_clients.py) per
row group, N in --clients; a markdown table with ratios to in-process and to the best peer, and the
issue's targets checked.

    python benchmarks/bench_peers.py                                  # mlp and ppocr_det, 1 and 8 clients
    python benchmarks/bench_peers.py --models resnet_nhwc,transformer,wide_mlp --clients 8   # plan_models.py
    python benchmarks/bench_peers.py --models mlp --clients 8 --seconds 1 --rounds 1
    python benchmarks/bench_peers.py --peers mlserver,pytriton        # leave Ray out
    python benchmarks/bench_peers.py --markdown out.md --json out.json

Each peer runs from its own throwaway venv under ~/.cache/edgeserve-bench/ (created on first use, pip's
progress shown; --no-install: use what is there), so its pins do not touch edgeserve's .venv. A peer
that does not install, import or start is skipped and the table says why. Ray binds some services to
every interface: when Ray is asked for, the measurement runs inside a new network namespace that has
only `lo` (`unshare --net`, root needed; otherwise Ray is skipped). Every server listens on 127.0.0.1;
every phase is bounded by a request count and a time limit; peers start in process groups of their
own and only those groups (and the descendants seen in them) are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlserver_peer
import pytriton_peer
import ray_peer
from client_pool import ClientPool
from common import (
    CpuMeter,
    InProcess,
    PausedTree,
    Result,
    Workload,
    bench_repository,
    chosen_workloads,
    machine_facts,
    prepare_samples,
    progress,
    run_connected,
    run_threads,
    served_config,
    workload_parser,
)
from es_server import RunningServer, start_server
from peer_clients import CALLERS, one_call
from peer_report import render, targets
from peers import VENV_DIR, PeerProcess, describe, ort_spec
from plan_models import BUILDERS, build_all

PEERS = ("pytriton", "mlserver", "ray")  # measured in this order, after edgeserve


class Side:
    """One server measured: its process (tree), and the address of each transport it is measured on."""

    def __init__(self, name: str, pid: int, addresses: dict[str, str], stop: Any) -> None:
        self.name, self.pid, self.addresses, self.stop = name, pid, addresses, stop
        self.paused = PausedTree()

    def pause(self) -> None:
        self.paused.pause(self.pid)

    def resume(self) -> None:
        self.paused.resume()


def only_running(sides: list[Side], running: Side | None, enabled: bool) -> None:
    """Resume `running` (None: every side paused, for the in-process phases), pause the others."""
    if not enabled:
        return
    for side in sides:
        if side is not running:
            side.pause()
    if running is not None:
        running.resume()
        time.sleep(0.2)  # let a resumed server catch up with its timers before the phase


# -- the venvs (outside the namespace: pip needs the network) -----------------------------------------
def prepare(peer: str, venv_dir: Path, install: bool) -> tuple[str | None, str]:
    if peer == "mlserver":
        return mlserver_peer.prepare(venv_dir, install)
    if peer == "ray":
        return ray_peer.prepare(venv_dir, install)
    return pytriton_peer.pytriton_python(venv_dir / "pytriton-venv", install)


def in_namespace(argv: list[str]) -> int:
    """Run this script again inside a new network namespace with only `lo` up; its exit status."""
    cmd = ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()), *argv, "--in-netns"]
    progress("running the measurement in a new network namespace (only `lo`): unshare --net")
    return subprocess.run(cmd, check=False).returncode


def netns_problem() -> str:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return "Ray binds services to every interface; a network namespace (unshare --net, root) is needed"
    probe = subprocess.run(
        ["unshare", "--net", "--", "ip", "link", "set", "lo", "up"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return "" if probe.returncode == 0 else f"unshare --net failed: {probe.stderr.strip()[:200]}"


# -- starting the sides ---------------------------------------------------------------------------------
def start_peer(peer: str, python: str, specs: list[dict[str, Any]]) -> Side:
    marker = None
    if peer == "pytriton":
        pspecs = [s["pytriton"] for s in specs]
        process, http_port, grpc_port, log = pytriton_peer.start(python, pspecs, new_session=True)
        proc = PeerProcess("pytriton", adopt=(process, log))
        base = f"http://127.0.0.1:{http_port}"
        proc.ready_urls = [
            f"{base}/v2/health/ready",
            *(f"{base}/v2/models/{s['model']}/ready" for s in specs),
        ]
        grpc, http = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
        addresses = {"gRPC unary": grpc, "gRPC stream": grpc, "HTTP": http}
    elif peer == "mlserver":
        proc, addresses = mlserver_peer.start(python, specs)
    else:
        proc, addresses, marker = ray_peer.start(python, specs)
    try:
        proc.wait_ready(300, marker)
    except BaseException:
        proc.stop()
        raise
    return Side(peer, proc.pid, addresses, proc.stop)


def start_sides(
    args: argparse.Namespace,
    works: list[Workload],
    repository: Path,
    pythons: dict[str, str],
    report: dict[str, Any],
) -> tuple[list[Side], dict[str, InProcess]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    extra = ["--host", "127.0.0.1", "--log-level", "WARNING"]
    for work in works:
        extra += ["--load-model", work.model]
    progress(f"starting edgeserve ({', '.join(w.model for w in works)}, onnxruntime)")
    # the plan's background race on, as on a device, and waited for: each side gets its final layout
    env = {"EDGESERVE_RUNTIME_RACE_BACKGROUND": "true"}
    server: RunningServer = start_server(repository, tmp, args=extra, timeout=240, env=env)
    try:
        InProcess.wait_final(server.base, [w.model for w in works])
    except BaseException:  # not a side yet: nobody else stops it
        server.stop()
        raise
    grpc, http = server.grpc_url, server.http_url
    es_addresses = {
        "gRPC unary": grpc,
        "gRPC stream": grpc,
        "HTTP": http,
        "ZeroMQ": server.zmq_endpoint,
        "ZeroMQ + shm": server.zmq_endpoint,
    }
    sides = [Side("edgeserve", server.process.pid, es_addresses, server.stop)]
    inprocs = {w.model: InProcess.matching(repository, w.model, server.base) for w in works}
    specs = []
    for work in works:
        config_path = served_config(server.base, work.model, tmp)
        spec = ort_spec(config_path, work, inprocs[work.model])
        spec["pytriton"] = pytriton_peer.peer_spec(config_path, work, inprocs[work.model])
        specs.append(spec)
        report["setup"].append(describe(spec) + " on every side")
    for peer, python in pythons.items():
        progress(f"starting {peer} with the same models, runtime options and batching ...")
        try:
            sides.append(start_peer(peer, python, specs))
        except Exception as exc:
            report["skipped"][peer] = f"did not start: {exc}"
            progress(f"{peer} skipped: {report['skipped'][peer]}")
    return sides, inprocs


# -- measuring ------------------------------------------------------------------------------------------
def check(side: Side, transport: str, work: Workload, x: np.ndarray, want: np.ndarray) -> str:
    """'' when the side's output over `transport` equals the in-process output, else why not."""
    try:
        got = asyncio.run(one_call(CALLERS[transport](side.addresses[transport], work, x, 1)))
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    return ""


def remote(
    label: str,
    side: Side,
    transport: str,
    work: Workload,
    x: np.ndarray,
    clients: int,
    seconds: float,
    meter: CpuMeter | None,
    pool: ClientPool | None = None,
) -> Result:
    if pool is not None:
        return pool.run(label, transport, side.addresses[transport], work, x, clients, seconds, meter)
    caller = CALLERS[transport](side.addresses[transport], work, x, clients)
    return run_connected(label, caller, clients, work.max_requests, seconds, meter)


def measure(
    args: argparse.Namespace,
    works: list[Workload],
    sides: list[Side],
    inprocs: dict[str, InProcess],
    report: dict[str, Any],
    pool: ClientPool | None = None,
) -> None:
    generators = {"bench": os.getpid()}
    for i, pid in enumerate(pool.pids if pool is not None else []):
        generators[f"bench:{i}"] = pid  # the client processes: the load generator too
    meter = CpuMeter({**generators, **{s.name: s.pid for s in sides}}, with_children=[s.name for s in sides])
    for work in works:
        inproc = inprocs[work.model]
        x = np.random.default_rng(0).random(work.shape, dtype=np.float32)
        want = inproc.infer({work.input_name: x})[work.output_name]
        plan: list[tuple[Side, str]] = []
        for side in sides:
            for transport in side.addresses:
                why = check(side, transport, work, x, want)
                if why:
                    report["skipped"][f"{side.name} {transport} ({work.model})"] = (
                        f"output check failed: {why}"
                    )
                    progress(f"{work.model}: {side.name} {transport}: {why}")
                else:
                    plan.append((side, transport))
        progress(f"{work.model}: {len(plan)} side/transport pairs return the in-process output")

        def in_process(inproc: InProcess = inproc, x: np.ndarray = x, work: Workload = work) -> None:
            inproc.infer({work.input_name: x})

        for clients in [int(c) for c in args.clients.split(",")]:
            runs: dict[tuple[str, str], list[Result]] = {}
            for rnd in range(args.rounds):  # A B C .. A B C: noise hits every phase alike
                tag = f"{work.model} x{clients}, round {rnd + 1}/{args.rounds}"
                only_running(sides, None, args.pause_idle)
                run_threads("warmup", in_process, clients, work.max_requests, args.warmup)
                r = run_threads("in-process", in_process, clients, work.max_requests, args.seconds, meter)
                runs.setdefault(("in-process", ""), []).append(r)
                progress(f"{tag}: in-process {r.throughput:.0f}/s")
                for side, transport in plan:
                    only_running(sides, side, args.pause_idle)
                    remote("warmup", side, transport, work, x, clients, args.warmup, None, pool)
                    r = remote(side.name, side, transport, work, x, clients, args.seconds, meter, pool)
                    runs.setdefault((side.name, transport), []).append(r)
                    progress(f"{tag}: {side.name} {transport} {r.throughput:.0f}/s, errors {r.errors}")
            for side in sides:
                side.resume()
            for (name, transport), results in runs.items():
                r = sorted(results, key=lambda r: r.throughput)[len(results) // 2]  # the median round
                report["rows"].append(
                    {
                        "model": work.model,
                        "clients": clients,
                        "side": name,
                        "transport": transport,
                        "rps": r.throughput,
                        "p50_ms": r.p50_ms,
                        "p99_ms": r.p99_ms,
                        "requests": len(r.latencies_s),
                        "errors": r.errors,
                        "first_error": r.first_error[:160],
                        "cpu_bench": sum(v for k, v in r.cpu.items() if k in generators),
                        "cpu_server": r.cpu.get(name, 0.0),
                        "cpu_others": sum(v for k, v in r.cpu.items() if k not in generators and k != name),
                        "rounds_rps": [round(x.throughput, 1) for x in results],
                    }
                )


# -- main -----------------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    parser = workload_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="time limit per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is kept")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list of peers ('' = none)")
    parser.add_argument("--venv-dir", type=Path, default=VENV_DIR, help="where the peers' venvs live")
    parser.add_argument("--no-install", action="store_true", help="use the peers' venvs only if they work")
    parser.add_argument(
        "--netns",
        choices=("auto", "off"),
        default="auto",
        help="auto: measure in a new network namespace when Ray runs; off: never (no Ray)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="drive every remote row from this many client processes (the clients spread over them); "
        "0 = one event loop in this process",
    )
    parser.add_argument(
        "--no-pause-idle",
        dest="pause_idle",
        action="store_false",
        help="leave the servers not being measured running (default: paused with SIGSTOP meanwhile)",
    )
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--render", type=Path, help="print the table of a saved --json run and exit")
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


@contextlib.contextmanager
def model_source(samples: Path, models: list[str]) -> Any:
    """`samples` itself, or, when plan_models.py's models are asked for, a temporary folder holding
    them (built, seeded) beside links to the sample models."""
    built = [m for m in models if m in BUILDERS]
    if not built:
        yield samples
        return
    with tempfile.TemporaryDirectory(prefix="bench-peers-models-") as tmp:
        source = Path(tmp)
        progress(f"building {', '.join(built)} (plan_models.py)")
        build_all(source, built)
        for model in models:
            if model not in BUILDERS:
                (source / model).symlink_to((samples / model).resolve())
        yield source


def main() -> int:
    args = parse()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    works = chosen_workloads(args)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEERS)}")
    report: dict[str, Any] = {
        "rows": [],
        "setup": [],
        "skipped": {},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    pythons: dict[str, str] = {}
    for peer in peers:
        python, why = prepare(peer, args.venv_dir, not (args.no_install or args.in_netns))
        if python is None:
            report["skipped"][peer] = why
            progress(f"{peer} skipped: {why}")
        else:
            pythons[peer] = python
    if "ray" in pythons and not args.in_netns:
        why = "--netns off given" if args.netns == "off" else netns_problem()
        if not why:
            return in_namespace(sys.argv[1:])
        report["skipped"]["ray"] = f"not run: {why}"
        del pythons["ray"]
    if args.in_netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
        report["netns"] = "measured inside a new network namespace with only lo (unshare --net)"
    prepare_samples(args.model_repository, works)
    report["machine"] = machine_facts()
    t0 = time.monotonic()
    with (
        model_source(args.model_repository, [w.model for w in works]) as source,
        bench_repository("onnxruntime", [w.model for w in works], source) as repository,
    ):
        sides: list[Side] = []
        inprocs: dict[str, InProcess] = {}
        pool = ClientPool(args.client_processes) if args.client_processes > 0 else None
        if pool is not None:
            report["client_processes"] = args.client_processes
        report["paused_idle"] = args.pause_idle
        try:
            sides, inprocs = start_sides(args, works, repository, pythons, report)
            measure(args, works, sides, inprocs, report, pool)
        finally:
            for side in sides:
                side.resume()
            if pool is not None:
                pool.close()
            for side in reversed(sides):
                progress(f"stopping {side.name}")
                side.stop()
            for inproc in inprocs.values():
                inproc.close()
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["load_end"] = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    report["targets"] = targets(report["rows"])
    text = render(report)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
