"""What edgeserve adds to gRPC: its ModelInfer and ModelStreamInfer against a bare `grpc.aio` server
that answers the very same request bytes with the very same reply bytes and does nothing else.

Payloads: a small tensor (FP32 [1, 16]) and a 600 KB frame (FP32 [1, 3, 224, 224]), each through an
ONNX Identity model on ONNX Runtime (edgeserve's work: parse, data plane, runtime, encode). The
replies the bare server sends are the ones edgeserve sent for those requests, captured first. One
client process per cell (raw `grpc.aio`, bytes in and out, one request in flight), rounds alternating
the two servers, the one not measured paused (SIGSTOP). Reported per cell: p50 round trip of each
(median of the rounds' p50s), and what edgeserve adds, (edgeserve p50 / bare p50 - 1), per round and
its median, with the load average at the start of each round. Issue 36's aim: <= 10% on the small
tensor, <= 3% on the 600 KB frame.

    python benchmarks/bench_grpc_vs_bare.py --rounds 4 --seconds 2
    python benchmarks/bench_grpc_vs_bare.py --bare-options edgeserve   # bare with edgeserve's server options

Loopback only; every phase is bounded in time; only the processes started here are stopped, by pid.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fastpath_ab import Variant, start_server
from common import ROOT, PausedTree, bench_parser, free_port, machine_facts, progress
from tritonclient.grpc import service_pb2

from edgeserve.cli import GRPC_EXPERIMENTS

PAYLOADS = {"small": (1, 16), "600KB": (1, 3, 224, 224)}
MODES = ("unary", "stream")
SERVICE = "/inference.GRPCInferenceService/"

BARE = """
import asyncio, sys
import grpc
port, unary, stream = int(sys.argv[1]), open(sys.argv[2], "rb").read(), open(sys.argv[3], "rb").read()
options = [("grpc.max_receive_message_length", 64 << 20)]
if sys.argv[4] == "edgeserve":  # the channel options edgeserve's server sets (keepalive, limits, ...)
    from edgeserve.frontends.grpc.server import server_options
    options = server_options(64 << 20)
def same(data): return data
async def infer(request, context): return unary
async def stream_infer(requests, context):
    async for _ in requests:
        yield stream
async def main():
    server = grpc.aio.server(options=options)
    methods = {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer, same, same),
               "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream_infer, same, same)}
    service = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", methods)
    server.add_generic_rpc_handlers((service,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""

CLIENT = """
import asyncio, json, sys, time
import grpc
port, mode, body, seconds = int(sys.argv[1]), sys.argv[2], open(sys.argv[3], "rb").read(), float(sys.argv[4])
def same(data): return data
async def main():
    options = [("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    if mode == "unary":
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", same, same)
        async def once(): await call(body, timeout=30)
        async def close(): pass
    else:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer", same, same)()
        async def once():
            await stream.write(body)
            await stream.read()
        async def close(): await stream.done_writing()
    until, warm = time.monotonic() + 1.0, 0
    while time.monotonic() < until:  # warm-up
        await once()
        warm += 1
    times, until = [], time.monotonic() + seconds
    while time.monotonic() < until and len(times) < 200000:
        start = time.perf_counter()
        await once()
        times.append(time.perf_counter() - start)
    await close()
    await channel.close()
    times.sort()
    print(json.dumps({"p50_ms": 1e3 * times[len(times) // 2], "calls": len(times) + warm}))
asyncio.run(main())
"""


def build_identity(path: Path, shape: tuple[int, ...]) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, list(shape))],
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    dims = ", ".join(str(d) for d in shape)
    (path.parent.parent / "config.pbtxt").write_text(
        f'backend: "onnxruntime"\nmax_batch_size: 0\n'
        f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [{dims}] }}]\n'
        f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [{dims}] }}]\n'
        "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
    )


def request_bytes(model: str, shape: tuple[int, ...]) -> bytes:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name=model, id="1")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend(shape)
    request.raw_input_contents.append(data.tobytes())
    return bytes(request.SerializeToString())


def capture(port: int, body: bytes) -> tuple[bytes, bytes]:
    """edgeserve's unary and streamed replies to `body` (checked to be answers, not errors)."""
    import grpc

    def same(data: bytes) -> bytes:
        return data

    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        unary = ch.unary_unary(SERVICE + "ModelInfer", same, same)(body, timeout=60)
        streamed = ch.stream_stream(SERVICE + "ModelStreamInfer", same, same)(iter([body]), timeout=60)
        stream = next(iter(streamed))
    reply = service_pb2.ModelStreamInferResponse.FromString(stream)
    if reply.error_message or not service_pb2.ModelInferResponse.FromString(unary).raw_output_contents:
        raise SystemExit(f"edgeserve did not answer: {reply.error_message}")
    return unary, stream


def server_cpu(pid: int) -> float:
    """CPU seconds of the server process so far (its threads included; warm-up calls too)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def run_client(port: int, mode: str, body_path: Path, seconds: float) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(port), mode, str(body_path), str(seconds)],
        capture_output=True, text=True, timeout=seconds + 120, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"client failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--bare-options", choices=("grpc", "edgeserve"), default="grpc",
                        help="the bare server's options: grpcio's defaults, or edgeserve's server_options")
    parser.add_argument("--payloads", default=",".join(PAYLOADS), help="of " + ", ".join(PAYLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)  # both servers and the clients alike
    tmp = Path(tempfile.mkdtemp(prefix="es-grpcbare-"))
    for name, shape in PAYLOADS.items():
        build_identity(tmp / "models" / f"ident_{name}" / "1" / "model.onnx", shape)
    edgeserve = Variant("edgeserve", ROOT)
    rows = []
    facts = machine_facts()
    server = start_server(edgeserve, tmp / "models", tmp)
    paused = {"edgeserve": PausedTree(), "bare": PausedTree()}
    bare: subprocess.Popen[str] | None = None
    try:
        for name, shape in PAYLOADS.items():
            if name not in args.payloads.split(","):
                continue
            body = request_bytes(f"ident_{name}", shape)
            body_path = tmp / f"request-{name}.bin"
            body_path.write_bytes(body)
            paused["edgeserve"].resume()
            unary, stream = capture(server.grpc_port, body)
            (tmp / "unary.bin").write_bytes(unary)
            (tmp / "stream.bin").write_bytes(stream)
            port = free_port()
            bare = subprocess.Popen(
                [sys.executable, "-c", BARE, str(port), str(tmp / "unary.bin"), str(tmp / "stream.bin"),
                 args.bare_options],
                stdout=subprocess.PIPE, text=True, cwd=ROOT,
            )  # fmt: skip
            assert bare.stdout is not None
            if bare.stdout.readline().strip() != "ready":
                raise SystemExit("the bare grpc.aio server did not start")
            ports = {"edgeserve": server.grpc_port, "bare": port}
            pids = {"edgeserve": server.process.pid, "bare": bare.pid}
            for mode in args.modes.split(","):
                cells: dict[str, list[float]] = {"edgeserve": [], "bare": []}
                work: dict[str, list[float]] = {"edgeserve": [], "bare": []}  # server CPU µs per call
                loads = []
                for rnd in range(args.rounds):
                    loads.append(os.getloadavg()[0])
                    for kind in ("edgeserve", "bare") if rnd % 2 == 0 else ("bare", "edgeserve"):
                        other = "bare" if kind == "edgeserve" else "edgeserve"
                        paused[other].pause(pids[other])
                        paused[kind].resume()
                        cpu0 = server_cpu(pids[kind])
                        result = run_client(ports[kind], mode, body_path, args.seconds)
                        cells[kind].append(result["p50_ms"])
                        work[kind].append(1e6 * (server_cpu(pids[kind]) - cpu0) / max(1.0, result["calls"]))
                    progress(f"{name} {mode} round {rnd + 1}: edgeserve {cells['edgeserve'][-1]:.3f} ms, "
                             f"bare {cells['bare'][-1]:.3f} ms")  # fmt: skip
                added = [e / b - 1 for e, b in zip(cells["edgeserve"], cells["bare"], strict=True)]
                rows.append({"payload": name, "mode": mode, "added": added, "load": loads,
                             "edgeserve_p50_ms": statistics.median(cells["edgeserve"]),
                             "bare_p50_ms": statistics.median(cells["bare"]),
                             "added_median": statistics.median(added),
                             "server_cpu_us": {k: statistics.median(v) for k, v in work.items()},
                             })  # fmt: skip
            paused["bare"].resume()
            bare.kill()
            bare.wait(10)
            bare = None
    finally:
        for tree in paused.values():
            tree.resume()
        if bare is not None:
            bare.kill()
        server.stop()
    print(f"\n{facts}\nONNX Identity on ONNX Runtime; one request in flight; "
          "p50 round trip (median of rounds)\n")
    print("| payload | mode | edgeserve ms | bare grpc.aio ms | edgeserve adds (median) | per round "
          "| server CPU µs/call: edgeserve, bare | load average |")
    print("|---|---|--:|--:|--:|---|--:|---|")
    for row in rows:
        rounds = ", ".join(f"{a:+.0%}" for a in row["added"])
        loads = ", ".join(f"{x:.1f}" for x in row["load"])
        print(f"| {row['payload']} | {row['mode']} | {row['edgeserve_p50_ms']:.3f} "
              f"| {row['bare_p50_ms']:.3f} | {row['added_median']:+.0%} | {rounds} "
              f"| {row['server_cpu_us']['edgeserve']:.0f}, {row['server_cpu_us']['bare']:.0f} "
              f"| {loads} |")  # fmt: skip
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / f"bench_grpc_vs_bare-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "machine": facts, "rows": rows}, indent=2))
    progress(f"results: {out}; work folder {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
