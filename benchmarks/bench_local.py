"""The local fast path, side by side in one run: the same model and inputs (a 600 KB frame in, a 4 KB
result out) called

    inproc       in-process: the runtime the server runs (--backend, default onnxruntime), with the
                 server's own choice of options (common.InProcess), called directly
    zmq_shm      edgeserve over ZeroMQ, the frame in a slot of a shared-memory ring (FrameRing),
                 written there by the producer (as a camera/decoder writing into the slot does);
                 client and server as they come: the client busy-waits up to 500 us for a reply
                 while replies come that fast (every ZeroMQ mode but the next uses it so), the
                 server's ZeroMQ thread up to [zmq] spin_us = 200 us for the next request
    zmq_shm_nospin the same with ZmqClient(spin_us=0): the client sleeps at once while it waits
    zmq_shm_write the same as zmq_shm, but the producer copies each frame into its slot per request
                 with the documented API, `slot.write(frame)`
    zmq_inline   edgeserve over ZeroMQ, the frame inline in the message (zero-copy send)
    grpc_shm     edgeserve over gRPC (tritonclient), the frame in Triton system shared memory
    grpc_plain   edgeserve over gRPC unary ModelInfer (tritonclient), the frame in the message

with 1 client (and 4), one request in flight per client; p50/p99 latency, round trips/s, ratios,
CPU share of the load generator, and the issue's two targets checked (PASS/FAIL):
  - zmq_shm_write round trips/s >= 5x grpc_plain (gRPC unary), 1 client, against the fastest gRPC
    phase (each phase is a new connection; tritonclient connections settle at ~1 ms or ~2.4 ms)
  - zmq_shm_write p50 - inproc p50 < 0.3 ms, 1 client
(checked on zmq_shm_write, the documented API, when it ran; on zmq_shm otherwise)

    python benchmarks/bench_local.py                 # 1 and 4 clients, 3 s per phase, 2 rounds
    python benchmarks/bench_local.py --seconds 1 --rounds 1 --clients 1
    python benchmarks/bench_local.py --backend openvino   # both sides on OpenVINO

Phases run in the order above, then again (rounds), and the figures pool the rounds. The in-process call
and zmq_shm both start from a frame already in memory (a numpy array; a ring slot); zmq_shm_write
and grpc_shm add the producer's copy of the frame into shared memory per request. The model's config
pins --backend (`plan`: no pin, the runtime plan chooses; for this 12 KB model that is onnxruntime);
the in-process side loads what the server's selector chooses for that config, and the server's choice
is read back and must match. With N in-process clients, N threads share the one instance, one call at
a time, first come first served (as the server's worker does).
Each remote client is its own process. Loopback only; every loop is bounded by
a request count and a time limit; only the processes started here are stopped, by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    ROOT,
    InProcess,
    add_backend_argument,
    machine_facts,
    percentile,
    progress,
)
from es_server import start_server
from local_clients import MODEL, OUT, SHAPE, Caller, run_phase

MODES = ("inproc", "zmq_shm", "zmq_shm_nospin", "zmq_shm_write", "zmq_inline", "grpc_shm", "grpc_plain")
CONFIG = """max_batch_size: 4
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [3, 224, 224] }]
output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [1024] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
dynamic_batching { }
"""


def build_model(path: Path) -> None:
    """Global average pool -> flatten -> [3,1024] matmul: little compute, so transport shows."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((3, OUT)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["INPUT0"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("MatMul", ["flat", "W"], ["OUTPUT0"]),
        ],
        "frame_pool",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["N", OUT])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


# -- the server -----------------------------------------------------------------------------------------
def grpc_available(url: str) -> str | None:
    try:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        try:
            live = client.is_model_ready(MODEL)
        finally:
            client.close()
    except Exception as exc:
        return f"grpc frontend not available ({type(exc).__name__}: {str(exc)[:120]})"
    return None if live else "grpc frontend not available (model not ready over gRPC)"


def check_outputs(modes: list[str], target: dict[str, Any]) -> None:
    """Every mode must return the in-process result before anything is timed."""
    want = Caller("inproc", target).call()
    for mode in modes:
        caller = Caller(mode, target)
        try:
            got = caller.call()
        finally:
            caller.close()
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise SystemExit(f"{mode}: output differs from the in-process result")


# -- report -------------------------------------------------------------------------------------------
def summarise(phases: list[dict[str, Any]], modes: list[str], clients: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in clients:
        for mode in modes:
            mine = [p for p in phases if p["mode"] == mode and p["clients"] == n]
            latencies = [lat for p in mine for lat in p["latencies"]]
            wall = sum(p["wall"] for p in mine)
            rows.append(
                {
                    "mode": mode,
                    "clients": n,
                    "requests": len(latencies),
                    "rps": len(latencies) / wall if wall > 0 else 0.0,
                    "p50_ms": percentile(latencies, 50) * 1e3,
                    "p99_ms": percentile(latencies, 99) * 1e3,
                    "client_cpu_pct": sum(p["client_cpu_pct"] for p in mine) / max(1, len(mine)),
                    "server_cpu_pct": sum(p["server_cpu_pct"] for p in mine) / max(1, len(mine)),
                    "errors": [e for p in mine for e in p["errors"]][:3],
                    # each phase is a fresh connection per client: gRPC unary differs by connection
                    "phase_rps": [len(p["latencies"]) / p["wall"] if p["wall"] > 0 else 0.0 for p in mine],
                    "phase_p50_ms": [percentile(p["latencies"], 50) * 1e3 for p in mine],
                }
            )
    return rows


def report(rows: list[dict[str, Any]], skipped: dict[str, str], fps: float = 0.0) -> dict[str, Any]:
    def row(mode: str, n: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["mode"] == mode and r["clients"] == n and r["requests"]), None)

    pace = f"one frame per {1e3 / fps:.1f} ms per client" if fps else "one request in flight per client"
    print(f"\n600 KB frame in (FP32 {list(SHAPE)}), 4 KB out; {pace}\n")
    print("| mode | clients | round trips/s | p50 ms | p99 ms | x gRPC unary | p50 added to in-process "
          "| CPU load gen / server |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        grpc, inproc = row("grpc_plain", r["clients"]), row("inproc", r["clients"])
        ratio = f"{r['rps'] / grpc['rps']:.1f}" if grpc and grpc["rps"] and not fps else "-"
        extra = f"{r['p50_ms'] - inproc['p50_ms']:+.3f} ms" if inproc and r["mode"] != "inproc" else "—"
        print(f"| {r['mode']} | {r['clients']} | {r['rps']:,.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
              f"{ratio} | {extra} | {r['client_cpu_pct']:.0f}% / {r['server_cpu_pct']:.0f}% |")  # fmt: skip
        for error in r["errors"]:
            print(f"    error: {error}")
    for mode, why in skipped.items():
        print(f"{mode}: skipped: {why}")
    print("\n(CPU is % of the whole machine: the load generator processes / the server)")
    fast = "zmq_shm_write" if row("zmq_shm_write", 1) else "zmq_shm"
    zmq, grpc, inproc = row(fast, 1), row("grpc_plain", 1), row("inproc", 1)
    targets: dict[str, Any] = {}
    if fps:
        print("targets: not checked (they are for back-to-back calls; this run was paced)")
        return targets
    if zmq and grpc:
        # Against gRPC's fastest connection of the run, not the pooled figure: a tritonclient
        # connection settles at about 1 ms or at about 2.4 ms per round trip and stays there.
        per_phase = grpc.get("phase_rps") or [grpc["rps"]]
        best = max(per_phase)
        ratio = zmq["rps"] / best
        targets[f"{fast}_vs_grpc_unary_rps"] = ratio
        if len(per_phase) > 1:
            p50s = ", ".join(f"{p:.2f}" for p in grpc.get("phase_p50_ms", []))
            print(f"gRPC unary per connection: {', '.join(f'{r:.0f}' for r in per_phase)} rt/s "
                  f"(p50 {p50s} ms)")  # fmt: skip
        print(
            f"target 1: {fast} {zmq['rps']:.0f} rt/s = {ratio:.1f}x gRPC unary's fastest connection "
            f"{best:.0f} rt/s (>= 5x): {'PASS' if ratio >= 5 else 'FAIL'}"
        )
    else:
        print("target 1: not measured (gRPC unary skipped)")
    if zmq and inproc:
        added = zmq["p50_ms"] - inproc["p50_ms"]
        targets[f"{fast}_added_p50_ms"] = added
        print(
            f"target 2: {fast} p50 {zmq['p50_ms']:.3f} ms - in-process p50 {inproc['p50_ms']:.3f} ms = "
            f"{added:.3f} ms (< 0.3 ms): {'PASS' if added < 0.3 else 'FAIL'}"
        )
    return targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per phase")
    parser.add_argument("--rounds", type=int, default=2, help="A B C D E repeated this many times")
    parser.add_argument("--clients", default="1,4", help="comma-separated client counts")
    parser.add_argument("--modes", default=",".join(MODES))
    pacing = "one frame per 1/FPS s per client, as a camera sends (default: back to back)"
    parser.add_argument("--fps", type=float, default=0.0, help=pacing)
    add_backend_argument(parser)
    parser.add_argument("--render", type=Path, help="print the table and targets of a saved run and exit")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(f"{saved.get('machine', '')}; --backend {saved['args'].get('backend', 'onnxruntime')}: "
              f"{saved.get('runtime', '')} on both sides; args {saved['args']}")  # fmt: skip
        report(saved["rows"], saved["skipped"], float(saved["args"].get("fps") or 0.0))
        return 0
    clients = [int(c) for c in args.clients.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    workdir = Path(tempfile.mkdtemp(prefix="es-bench-"))
    repo = workdir / "models"
    build_model(repo / MODEL / "1" / "model.onnx")
    pin = "" if args.backend == "plan" else f'backend: "{args.backend}"\n'
    (repo / MODEL / "config.pbtxt").write_text(pin + CONFIG)
    facts = machine_facts()
    progress(f"starting edgeserve (model {MODEL}, {args.backend}, workdir {workdir})")
    server = start_server(repo, workdir, args=["--log-level", "WARNING"], timeout=180)
    target: dict[str, Any] = {"zmq": server.zmq_endpoint, "grpc": server.grpc_url, "http": server.base}
    try:
        skipped: dict[str, str] = {}
        why = grpc_available(target["grpc"])
        if why:
            skipped = {m: why for m in modes if m.startswith("grpc")}
            modes = [m for m in modes if m not in skipped]
        inproc = InProcess.matching(repo, MODEL, target.pop("http"))
        progress(f"runtime on both sides: {inproc.label}")
        target["instance"] = inproc
        check_outputs(modes, target)
        inproc_target = {"instance": target.pop("instance")}
        phases = []
        for rnd in range(args.rounds):
            for n in clients:
                for mode in modes:
                    progress(f"round {rnd + 1}/{args.rounds}: {mode} x{n} for {args.seconds:.0f}s")
                    phase_target = {**target, **inproc_target} if mode == "inproc" else target
                    phases.append(
                        run_phase(mode, n, phase_target, args.seconds, server.process.pid, args.fps)
                    )
                    last = phases[-1]
                    progress(
                        f"  {len(last['latencies'])} round trips, p50 "
                        f"{percentile(last['latencies'], 50) * 1e3:.3f} ms"
                        + (f", errors: {last['errors'][:1]}" if last["errors"] else "")
                    )
        rows = summarise(phases, modes, clients)
        print(f"\n{facts}; --backend {args.backend}: {inproc.label} on both sides")
        targets = report(rows, skipped, args.fps)
        out_dir = ROOT / "benchmarks" / "results"
        out_dir.mkdir(exist_ok=True)
        out = out_dir / f"bench_local-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "rows": rows,
                    "targets": targets,
                    "skipped": skipped,
                    "cpus": os.cpu_count(),
                    "machine": facts,
                    "runtime": inproc.label,
                },
                indent=2,
            )
        )
        progress(f"results: {out}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
