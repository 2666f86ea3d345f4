"""One client of bench_fastpath_ab.py, run in its own process (as a camera client is).

It imports only numpy and the `edgeserve` found on its path, so each variant's client runs that
variant's code (the orchestrator sets PYTHONPATH to the variant's source tree). Modes:

    write    ZeroMQ + shm ring: each frame copied into a slot with `slot.write(frame)` (the issue's case)
    inplace  ZeroMQ + shm ring: the frame already in its slot (a decoder writing there)
    inproc   the model called in this process, as the server runs it (benchmarks/common.InProcess)

Prints one JSON object: latencies (s), wall, CPU seconds of this process, a checksum of the output.
Every loop is bounded by a request count and a time limit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "frame_pool"
SHAPE = (1, 3, 224, 224)  # FP32: 602,112 bytes in; OUTPUT0 FP32 [1, 1024]: 4 KB out
MAX_REQUESTS = 200_000


def make_call(args: argparse.Namespace, x: np.ndarray) -> tuple[Any, Any]:
    if args.mode == "inproc":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import InProcess  # the runtime the server runs, with the server's choices

        inproc = InProcess(Path(args.repo), MODEL, json.loads(args.params))
        return (lambda: inproc.infer({"INPUT0": x})["OUTPUT0"]), inproc.close
    from edgeserve.client import ZmqClient

    extra = {} if args.spin_us < 0 else {"spin_us": args.spin_us}
    client = ZmqClient(args.endpoint, timeout=30, copy_inputs=False, **extra)
    ring = client.create_ring(slots=args.slots, slot_size=x.nbytes)
    if args.mode == "inplace":
        for slot in [ring.acquire() for _ in range(ring.slots)]:
            slot.ndarray(SHAPE, np.float32)[:] = x
            slot.release()

        def inplace() -> Any:
            slot = ring.acquire()
            return client.infer(MODEL, {"INPUT0": slot.tensor(SHAPE, np.float32)}).as_numpy("OUTPUT0")

        return inplace, client.close

    def write() -> Any:
        slot = ring.acquire()
        return client.infer(MODEL, {"INPUT0": slot.write(x)}).as_numpy("OUTPUT0")

    return write, client.close


def ctx_switches(pid: str = "self") -> int:
    """Context switches of every thread of a process so far (voluntary: it slept, e.g. waiting for a
    wake-up; involuntary: preempted): a count, not a time, so it says the same on a busy box."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        for line in text.splitlines():
            if "ctxt_switches:" in line:
                total += int(line.split()[1])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("write", "inplace", "inproc"), default="write")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--params", default="{}", help="inproc: config parameters the server chose (JSON)")
    parser.add_argument("--repo", default="", help="the model repository (inproc)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--start", type=float, default=0.0, help="time.time() to start measuring at")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--spin-us", type=int, default=-1, help="ZmqClient spin_us (-1: its default)")
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args()
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    call, close = make_call(args, x)
    try:
        checksum = float(np.asarray(call(), dtype=np.float64).sum())
        for _ in range(args.warmup):
            call()
        while time.time() < args.start:
            time.sleep(0.0005)
        latencies: list[float] = []
        cpu0, wall0, ctx0 = time.process_time(), time.perf_counter(), ctx_switches()
        deadline = wall0 + args.seconds
        while len(latencies) < MAX_REQUESTS and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            call()
            latencies.append(time.perf_counter() - t0)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        ctx = ctx_switches() - ctx0
    finally:
        close()
    calls = 1 + args.warmup + len(latencies)  # everything the server answered for this process
    json.dump(
        {"latencies": latencies, "wall": wall, "cpu": cpu, "checksum": checksum, "calls": calls, "ctx": ctx},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
