"""Model composition (issue 35): one pipeline, pre-process (Python) -> ONNX classifier -> post-process
(Python, argmax), on a 224 x 224 image whose normalised tensor (3 x 224 x 224 FP32, 602 KB) crosses
between the steps, composed four ways and timed side by side:

    three calls   the client calls pre, classifier and post itself (tritonclient gRPC), the 602 KB
                  tensor comes back to it and goes out again
    ensemble      one call to a Triton ensemble of the three models
    BLS           one call to a Python model that pre-processes, calls the classifier with
                  pb_utils.InferenceRequest(...).exec() and post-processes
    Ray Serve     the same three steps as Ray Serve deployments (the classifier an ORT session with
                  edgeserve's options), an ingress deployment awaiting their DeploymentHandles; the
                  client posts the raw image to Ray Serve's HTTP proxy (ray_composition.py)

plus the cost of one BLS hop above the called model's own time (a Python model times its exec() of the
classifier on the 602 KB tensor; the classifier's statistics give its own compute time) and a decoupled
model's stream (gRPC ModelStreamInfer, responses per second).

    python benchmarks/bench_composition.py                      # 3 rounds of 200 calls per way
    python benchmarks/bench_composition.py --calls 30 --rounds 1 --clients 2     # short, on a busy box
    python benchmarks/bench_composition.py --ray off                            # leave Ray Serve out

The ways take turns each round (latency: one client, back to back; throughput: --clients threads, twice
the calls; each phase ends at --calls or --seconds, whichever comes first: the row counts its calls). A
way whose models do not load or answer is reported with its error, not timed. Progress on stderr, the
markdown table on stdout. Only the processes started here are stopped.

Ray Serve runs from bench_peers' venv under ~/.cache/edgeserve-bench/ray-venv (ray[serve]==2.60.0,
built on first use with pip's progress; --no-install: use it only if it is there). Ray binds some
services to every interface, so when it runs the whole measurement (edgeserve too) runs again inside a
new network namespace that has only `lo` (`unshare --net`, root); where the venv or the namespace
cannot be had, the Ray Serve row says why. While one server's way is timed the other server's process
tree is stopped (SIGSTOP; --no-pause-idle: not), as bench_peers does. Ray's processes are stopped by
PID when the run ends, and the namespace goes with the last of them.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray_composition
from common import PausedTree, Result, cpu_flags, machine_facts, merge, progress, run_threads
from composition_models import image, write_repository
from es_server import RunningServer, start_server
from peers import VENV_DIR

Call = Callable[[], None]
MODELS = ("pre", "classifier", "post", "pipeline", "pipeline_bls", "bls_hop", "stream")


def grpc_ways(server: RunningServer, expected: int) -> dict[str, Call | str]:
    """Each way's call, or why it cannot run (its check failed)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    img = image()

    def infer(model: str, name: str, array: np.ndarray, datatype: str, output: str) -> np.ndarray:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        result: np.ndarray = client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput(output)]
                                          ).as_numpy(output)  # fmt: skip
        return result

    def three_calls() -> int:
        norm = infer("pre", "IMAGE", img, "UINT8", "NORM")
        logits = infer("classifier", "NORM", norm, "FP32", "LOGITS")
        return int(infer("post", "LOGITS", logits, "FP32", "CLASS")[0])

    ways: dict[str, Callable[[], int]] = {
        "three calls": three_calls,
        "ensemble": lambda: int(infer("pipeline", "IMAGE", img, "UINT8", "CLASS")[0]),
        "BLS": lambda: int(infer("pipeline_bls", "IMAGE", img, "UINT8", "CLASS")[0]),
    }
    return {name: checked(call, expected) for name, call in ways.items()}


def checked(call: Callable[[], int], expected: int) -> Call | str:
    try:
        got = call()
    except Exception as exc:  # the way does not work (yet): its row says why
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    if got != expected:
        return f"answered class {got}, expected {expected}"
    return lambda: None if call() == expected else _wrong()


def _wrong() -> None:
    raise AssertionError("wrong class")


def reference_class() -> int:
    """The pipeline in this process with onnxruntime: what every way must answer."""
    import onnxruntime as ort
    from composition_models import classifier_onnx

    with tempfile.TemporaryDirectory() as folder:
        session = ort.InferenceSession(
            str(classifier_onnx(Path(folder) / "c.onnx")), providers=["CPUExecutionProvider"]
        )
        mean = (np.array([0.485, 0.456, 0.406], np.float32) * 255).reshape(1, 3, 1, 1)
        scale = 1 / (np.array([0.229, 0.224, 0.225], np.float32) * 255).reshape(1, 3, 1, 1)
        norm = np.ascontiguousarray((image().transpose(0, 3, 1, 2).astype(np.float32) - mean) * scale)
        return int(np.argmax(session.run(["LOGITS"], {"NORM": norm})[0], axis=1)[0])


PHASES = ("compute_input", "compute_infer", "compute_output")


def bls_hop(server: RunningServer, calls: int) -> dict[str, float] | str:
    """The BLS exec() p50 and the classifier's phases per execution during those calls (us): its own time
    is compute_input + compute_infer (what a direct call also spends); the hop is exec() above that."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    norm = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    tensor = grpcclient.InferInput("NORM", list(norm.shape), "FP32")
    tensor.set_data_from_numpy(norm)

    def phases() -> dict[str, int]:
        stats = client.get_inference_statistics("classifier", as_json=True)["model_stats"][0]
        ns = {k: int(stats["inference_stats"][k].get("ns", 0)) for k in PHASES}
        return {**ns, "executions": int(stats.get("execution_count", 0))}

    try:
        client.infer("bls_hop", [tensor])
        before = phases()
        hops = [int(client.infer("bls_hop", [tensor]).as_numpy("HOP_NS")[0]) for _ in range(calls)]
        after = phases()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    executions = max(1, after["executions"] - before["executions"])
    figures = {k: (after[k] - before[k]) / executions / 1e3 for k in PHASES}
    figures["exec"] = statistics.median(hops) / 1e3
    figures["own"] = figures["compute_input"] + figures["compute_infer"]
    figures["hop"] = figures["exec"] - figures["own"]
    return figures


def stream_rate(server: RunningServer, per_request: int, requests: int) -> float | str:
    """Responses per second of the decoupled `stream` model over one gRPC stream."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: done.put(error if error is not None else result))
    count = np.array([per_request], np.int32)
    tensor = grpcclient.InferInput("COUNT", [1], "INT32")
    tensor.set_data_from_numpy(count)
    try:
        start, received = time.perf_counter(), 0
        for _ in range(requests):
            client.async_stream_infer("stream", [tensor], enable_empty_final_response=True)
            while True:
                item = done.get(timeout=120)  # a stream that stalls ends the row, not the bench
                if isinstance(item, Exception):
                    return f"{type(item).__name__}: {str(item)[:160]}"
                final = item.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
                received += 1
        seconds = time.perf_counter() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        client.stop_stream()
    if received != per_request * requests:
        return f"received {received} responses, expected {per_request * requests}"
    return received / seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200, help="calls per way and round (latency)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="threads of the throughput runs")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="time limit of each phase (Ray Serve is slow here)"
    )
    parser.add_argument(
        "--stream", type=int, default=1000, help="responses per streamed request (10 requests)"
    )
    parser.add_argument(
        "--ray",
        choices=("auto", "off"),
        default="auto",
        help="auto: the Ray Serve way where its venv and a network namespace can be had",
    )
    parser.add_argument("--venv-dir", type=Path, default=VENV_DIR, help="where bench_peers' venvs live")
    parser.add_argument("--no-install", action="store_true", help="use the Ray venv only if it works")
    parser.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                        help="leave Ray running while the other ways run, and edgeserve while Ray does "
                        "(default: the idle one stopped with SIGSTOP, as bench_peers does)")  # fmt: skip
    parser.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ray_python, ray_why = None, "--ray off given"
    if args.ray == "auto":
        ray_python, ray_why = ray_composition.prepare(args.venv_dir, not (args.no_install or args.in_netns))
        if ray_python is not None and not args.in_netns:
            ray_why = ray_composition.netns_problem()
            if not ray_why:
                progress("running the measurement in a new network namespace (only `lo`): unshare --net")
                return ray_composition.in_namespace(Path(__file__).resolve(), sys.argv[1:])
            ray_python = None
    if args.in_netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
    expected = reference_class()
    with tempfile.TemporaryDirectory(prefix="bench-composition-") as folder:
        tmp = Path(folder)
        repo = write_repository(tmp / "repo")
        progress("starting edgeserve serve (loading pre, classifier, post, pipeline, pipeline_bls, ...)")
        server = start_server(repo, tmp, args=["--no-zmq", "--log-level", "WARNING"], timeout=300)
        stop_ray: Callable[[], None] = lambda: None  # noqa: E731
        ray: ray_composition.Caller | str = ray_why
        paused = PausedTree()  # the server not being measured (Ray, or edgeserve while Ray is)
        try:
            ways = grpc_ways(server, expected)
            if ray_python is None:
                progress(f"Ray Serve: not run: {ray_why}")
            else:
                try:
                    ray, stop_ray = ray_composition.launch(ray_python, repo, server.base, image())
                except Exception as exc:  # setting it up failed: the row says why, the bench goes on
                    ray = f"setting it up failed: {type(exc).__name__}: {str(exc)[:200]}"
            ways["Ray Serve"] = ray if isinstance(ray, str) else checked(ray, expected)
            latency: dict[str, list[Result]] = {}
            throughput: dict[str, list[Result]] = {}
            for round_no in range(1, args.rounds + 1):
                for name, call in ways.items():
                    if isinstance(call, str):
                        continue
                    if args.pause_idle and isinstance(ray, ray_composition.Caller):
                        # the other server stopped (SIGSTOP): no idle CPU, no wake-ups in this phase
                        paused.resume()
                        paused.pause(server.process.pid if name == "Ray Serve" else ray.pid)
                        time.sleep(0.2)  # let a resumed server catch up with its timers first
                    progress(f"round {round_no}/{args.rounds}: {name}")
                    latency.setdefault(name, []).append(run_threads(name, call, 1, args.calls, args.seconds))
                    throughput.setdefault(name, []).append(
                        run_threads(name, call, args.clients, args.calls * 2, args.seconds))  # fmt: skip
            paused.resume()
            progress("one BLS hop")
            hop = bls_hop(server, args.calls)
            progress("decoupled stream")
            rate = stream_rate(server, args.stream, 10)
        finally:
            paused.resume()  # a stopped process would not see SIGTERM
            stop_ray()
            server.stop()
    report(ways, latency, throughput, hop, rate, args)
    return 0


Hop = dict[str, float] | str


def report(ways: dict[str, Call | str], latency: dict[str, list[Result]], throughput: dict[str, list[Result]],
           hop: Hop, rate: float | str, args: argparse.Namespace) -> None:  # fmt: skip
    print(f"{machine_facts()}; CPU flags: {cpu_flags(('avx2', 'avx512f', 'avx512_vnni', 'amx_tile'))}")
    ray_ran = not isinstance(ways.get("Ray Serve", ""), str)
    setup = [
        f"{args.rounds} rounds x up to {args.calls} calls per way or {args.seconds:.0f} s",
        f"latency: 1 client; throughput: {args.clients} clients, twice the calls",
        "tritonclient gRPC; Ray Serve over its HTTP proxy (the raw image bytes)",
        *(["in a network namespace with only lo"] if args.in_netns else []),
        *(["the server not being timed paused (SIGSTOP)"] if args.pause_idle and ray_ran else []),
    ]
    print("; ".join(setup) + "\n")
    print("| way | p50 ms | p90 ms | throughput req/s | calls (latency / throughput) | errors |")
    print("|---|---:|---:|---:|---:|---|")
    for name, call in ways.items():
        if isinstance(call, str):
            print(f"| {name} | - | - | - | - | did not run: {call} |")
            continue
        lat, thr = merge(latency[name]), merge(throughput[name])
        p90 = float(np.percentile(lat.latencies_s, 90)) * 1e3
        errors = lat.errors + thr.errors
        note = f"{errors}: {lat.first_error or thr.first_error}" if errors else "0"
        calls = f"{len(lat.latencies_s)} / {len(thr.latencies_s)}"
        print(f"| {name} | {lat.p50_ms:.2f} | {p90:.2f} | {thr.throughput:.0f} | {calls} | {note} |")
    print()
    if isinstance(hop, str):
        print(f"One BLS hop: did not run: {hop}")
    else:
        print(f"One BLS hop (602 KB NORM in, LOGITS out): exec() p50 {hop['exec']:.0f} us; the classifier's "
              f"own time {hop['own']:.0f} us per execution (compute_input + compute_infer); the hop above "
              f"it {hop['hop']:.0f} us (target < 300 us); the classifier's compute_output phase for these "
              f"calls {hop['compute_output']:.0f} us (part of the hop)")  # fmt: skip
    if isinstance(rate, str):
        print(f"Decoupled stream: did not run: {rate}")
    else:
        print(
            f"Decoupled stream (gRPC ModelStreamInfer, 10 requests x {args.stream} responses): "
            f"{rate:.0f} responses/s"
        )


if __name__ == "__main__":
    sys.exit(main())
