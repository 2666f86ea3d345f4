"""Python models (issue 15): what a call through the worker process costs over the same model.py
called in-process. Triton's identity model (OUTPUT0 = INPUT0, FP32), for a batch-1 tensor of 4
floats (16 B) and a 600 KB one (1 x 153600 FP32), in three ways:

    inproc   the model's own TritonPythonModel.execute([request]) in this process (pb_utils objects
             built around the array, the output taken back): the floor
    worker   PythonInstance.infer, as the scheduler calls it: inputs copied into the instance's shared
             memory, a JSON header over the socketpair, execute() in the worker, outputs copied out
    grpc     (--grpc) the whole server: tritonclient gRPC unary ModelInfer to `edgeserve serve`

    python benchmarks/bench_python_backend.py                   # 2000 / 500 calls per size, 3 rounds
    python benchmarks/bench_python_backend.py --calls 300 --rounds 1 --grpc

Each call starts from an array already in memory; p50 and p99 of per-call wall time over all rounds
(the modes take turns each round). Only the processes started here are stopped.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from python_models import load_model_file  # noqa: E402

IDENTITY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", in_0.as_numpy())]))
        return responses
"""
CONFIG = """
name: "identity"
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1, -1 ] }]
output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1, -1 ] }]
"""
SIZES = {"16 B": 4, "600 KB": 153_600}


def write_repo(root: Path) -> Path:
    (root / "identity" / "1").mkdir(parents=True)
    (root / "identity" / "config.pbtxt").write_text(CONFIG)
    path = root / "identity" / "1" / "model.py"
    path.write_text(IDENTITY)
    return path


def in_process(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    from edgeserve.backends.python import pb_utils

    sys.modules["triton_python_backend_utils"] = pb_utils
    model = load_model_file(path, "identity_model").TritonPythonModel()

    def call(array: np.ndarray) -> np.ndarray:
        request = pb_utils.InferenceRequest([pb_utils.Tensor("INPUT0", array)])
        response = model.execute([request])[0]
        out: np.ndarray = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
        return out

    return call


def through_worker(path: Path) -> tuple[Callable[[np.ndarray], np.ndarray], Any]:
    from edgeserve.backends.base import BackendOptions
    from edgeserve.backends.python import BACKEND
    from edgeserve.repository.config import parse_pbtxt

    _, config = BACKEND.inspect_config(path, parse_pbtxt(path.parent.parent / "config.pbtxt"), "bench")
    instance = BACKEND.load(path, config, BackendOptions())

    def call(array: np.ndarray) -> np.ndarray:
        out: np.ndarray = instance.infer({"INPUT0": array})["OUTPUT0"]
        return out

    return call, instance


def through_grpc(repo: Path, tmp: Path) -> tuple[Callable[[np.ndarray], np.ndarray], Any]:
    import tritonclient.grpc as grpcclient
    from es_server import start_server

    server = start_server(repo, tmp, args=["--no-zmq"])
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def call(array: np.ndarray) -> np.ndarray:
        tensor = grpcclient.InferInput("INPUT0", list(array.shape), "FP32")
        tensor.set_data_from_numpy(array)
        out: np.ndarray = client.infer("identity", [tensor]).as_numpy("OUTPUT0")
        return out

    return call, (client, server)


def timed(call: Callable[[np.ndarray], np.ndarray], array: np.ndarray, calls: int) -> list[int]:
    for _ in range(min(50, calls)):
        call(array)
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call(array)
        times.append(time.perf_counter_ns() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--calls", type=int, default=2000, help="calls per mode, size and round (600 KB: 1/4)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grpc", action="store_true", help="also time the whole server over gRPC")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-python-") as folder:
        tmp = Path(folder)
        path = write_repo(tmp / "repo")
        modes: dict[str, Callable[[np.ndarray], np.ndarray]] = {"inproc": in_process(path)}
        modes["worker"], instance = through_worker(path)
        remote: Any = None
        if args.grpc:
            modes["grpc"], remote = through_grpc(tmp / "repo", tmp)
        samples: dict[tuple[str, str], list[int]] = {}
        try:
            for _ in range(args.rounds):
                for size, count in SIZES.items():
                    array = np.random.default_rng(0).random((1, count), dtype=np.float32)
                    calls = args.calls if count < 1000 else max(1, args.calls // 4)
                    for mode, call in modes.items():
                        assert np.array_equal(call(array), array)
                        samples.setdefault((mode, size), []).extend(timed(call, array, calls))
        finally:
            instance.close()
            if remote is not None:
                remote[0].close()
                remote[1].stop()
    rows = []
    print(f"{platform.machine()}, {platform.python_version()}, numpy {np.__version__}")
    print(f"{'size':<8} {'mode':<7} {'p50 us':>9} {'p99 us':>9} {'p50 over inproc us':>19}")
    for size in SIZES:
        floor = statistics.median(samples[("inproc", size)]) / 1e3
        for mode in modes:
            times = sorted(samples[(mode, size)])
            p50 = statistics.median(times) / 1e3
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))] / 1e3
            rows.append({"size": size, "mode": mode, "p50_us": p50, "p99_us": p99, "over_us": p50 - floor})
            print(f"{size:<8} {mode:<7} {p50:>9.1f} {p99:>9.1f} {p50 - floor:>19.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
