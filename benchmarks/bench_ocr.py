"""The OCR pipeline (issue 15): frames/s and per-stage time of `ocr` (an ensemble of 4 Python and 3
ONNX steps) served by edgeserve, against the same pipeline run in-process by hand (the limit).

    python benchmarks/bench_ocr.py                       # 640x480 frame, 3 text lines, 4 rounds of 5 s
    python benchmarks/bench_ocr.py --seconds 3 --rounds 2 --size 1280x720

Modes, taking turns each round (A B C D A B C D ...), each after 1 s of unmeasured warm-up:
    inproc      the step functions of models/ocr_*/1/model.py called in this process, and the three
                PP-OCR models on the runtime, precision and threads the server chose (common.InProcess
                .matching, over the same race cache), crops in chunks of max_batch_size, one frame
                after another: no IPC, no serialization, no scheduling
    zmq-shm     ZmqClient, the frame written into a shared-memory ring slot, 1 frame in flight
    zmq-shm x4  the same, 4 frames in flight (steps of different frames overlap in the pipeline)
    grpc        tritonclient gRPC unary, 1 frame in flight

CPU per frame: user + system time of this process and of the server with its Python workers,
over the frames of each mode (less sensitive to other jobs on a shared box than frames/s).

Per stage: in-process, the wall time of each step; served, the ensemble's `ensemble_steps` statistics
(submit to outputs, queueing and the Python worker round trip included) and each composing model's
own compute time (`compute_infer` per request), both as deltas over the served rounds of 1 frame in
flight. Every mode's text is checked against the in-process result. JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, InProcess, machine_facts, percentile, progress
from python_models import sample_step

MODELS = ROOT / "models"
STEPS = ("ocr_pre", "ppocr_det", "ocr_boxes", "ppocr_cls", "ocr_rotate", "ppocr_rec", "ocr_decode")
LINES = ("EDGESERVE 2026", "Gate 7 - Bay 12", "Lot A4 23.5 kg")


def frame(width: int, height: int) -> np.ndarray:
    """A camera-like frame: grey gradient, three text lines in Pillow's built-in font, a little noise."""
    from PIL import Image, ImageDraw, ImageFont

    ys, xs = np.mgrid[0:height, 0:width]
    base = (200 + 40 * xs / width - 30 * ys / height).astype(np.uint8)
    image = Image.fromarray(np.stack([base, base, base], -1))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(24, height // 12))
    for i, text in enumerate(LINES):
        draw.text((width // 12 + 20 * i, height // 8 + i * height // 4), text, fill=(20, 20, 20), font=font)
    noise = np.random.default_rng(7).integers(-6, 7, (height, width, 3))
    return np.clip(np.asarray(image).astype(np.int16) + noise, 0, 255).astype(np.uint8)


class ByHand:
    """The pipeline in this process: the same functions and runtimes, nothing in between."""

    def __init__(self, http_base: str) -> None:
        names = ("ocr_pre", "ocr_boxes", "ocr_rotate", "ocr_decode")
        self.pre, self.boxes, self.rotate, self.decode = (sample_step(n) for n in names)
        self.characters = self.decode.load_characters(MODELS / "ocr_decode" / "1" / "ppocr_keys.txt")
        self.det, self.cls, self.rec = (InProcess.matching(MODELS, m, http_base)
                                        for m in ("ppocr_det", "ppocr_cls", "ppocr_rec"))  # fmt: skip
        self.stage_ns = dict.fromkeys(STEPS, 0)
        self.frames = 0

    @staticmethod
    def _batched(model: InProcess, x: np.ndarray, empty: tuple[int, ...], limit: int = 8) -> np.ndarray:
        if not len(x):
            return np.zeros(empty, np.float32)
        name = next(iter(model.instances[0].io.outputs)).name
        parts = [model.infer({"x": x[i : i + limit]})[name] for i in range(0, len(x), limit)]
        return np.concatenate(parts)

    def __call__(self, image: np.ndarray) -> list[str]:
        marks = [time.perf_counter_ns()]
        pre = self.pre.preprocess(image)
        marks.append(time.perf_counter_ns())
        prob = self.det.infer({"x": pre["DET_INPUT"]})["sigmoid_0.tmp_0"]
        marks.append(time.perf_counter_ns())
        found = self.boxes.extract(prob, image, pre["SHAPE"])
        marks.append(time.perf_counter_ns())
        cls = self._batched(self.cls, found["CLS_CROPS"], (0, 2))
        marks.append(time.perf_counter_ns())
        rec_input = self.rotate.rotate(found["REC_CROPS"], found["REC_WIDTHS"], cls)
        marks.append(time.perf_counter_ns())
        rec = self._batched(self.rec, rec_input, (0, 0, 6625))
        marks.append(time.perf_counter_ns())
        out = self.decode.finish(rec, found["BOXES"], self.characters)
        marks.append(time.perf_counter_ns())
        for step, begin, end in zip(STEPS, marks, marks[1:], strict=False):
            self.stage_ns[step] += end - begin
        self.frames += 1
        return [t.decode() for t in out["TEXT"]]


def _stats(http_base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{http_base}/v2/models/stats", timeout=30) as reply:
        return {s["name"]: s for s in json.loads(reply.read())["model_stats"]}


def _served_stages(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    frames = (
        after["ocr"]["inference_stats"]["success"]["count"]
        - before["ocr"]["inference_stats"]["success"]["count"]
    )
    stages: dict[str, dict[str, float]] = {}
    for b, a in zip(before["ocr"]["ensemble_steps"], after["ocr"]["ensemble_steps"], strict=True):
        step_ns = a["success"]["ns"] - b["success"]["ns"]
        model = a["model"]
        infer = (after[model]["inference_stats"]["compute_infer"]["ns"]
                 - before[model]["inference_stats"]["compute_infer"]["ns"])  # fmt: skip
        stages[model] = {
            "step_ms": step_ns / max(frames, 1) / 1e6,
            "compute_ms": infer / max(frames, 1) / 1e6,
        }
    return stages


def cpu_seconds(server_pid: int) -> float:
    """CPU time used so far by this process and by the server with its worker processes."""
    import psutil

    total = time.process_time()
    try:
        server = psutil.Process(server_pid)
        for process in (server, *server.children(recursive=True)):
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return total


def run(mode: str, call: Callable[[], list[str]], seconds: float, expected: list[str],
        latencies: dict[str, list[float]]) -> int:  # fmt: skip
    end = time.monotonic() + seconds
    count = 0
    while time.monotonic() < end:
        start = time.perf_counter()
        texts = call()
        latencies[mode].append(time.perf_counter() - start)
        if texts != expected:
            raise SystemExit(f"{mode}: read {texts}, in-process read {expected}")
        count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="640x480", help="WxH of the frame")
    parser.add_argument("--seconds", type=float, default=5.0, help="per mode per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_ocr.json")
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    image = frame(width, height)
    tmp = Path(tempfile.mkdtemp(prefix="edgeserve-bench-ocr-"))
    state = tmp / "state"
    os.environ["EDGESERVE_SERVER_STATE_DIR"] = str(state)  # the in-process plan reads the server's race cache
    print(machine_facts())
    sys.path.insert(0, str(ROOT / "tests"))
    import tritonclient.grpc as grpcclient
    from es_server import start_server

    from edgeserve.client import ZmqClient

    progress("starting edgeserve serve --load-model ocr")
    server = start_server(MODELS, tmp, args=["--load-model", "ocr", "--log-level", "WARNING"],
                          env={"EDGESERVE_SERVER_STATE_DIR": str(state)}, timeout=600)  # fmt: skip
    try:
        by_hand = ByHand(server.base)
        expected = by_hand(image)
        progress(f"in-process reads {expected}; det {by_hand.det.label}, rec {by_hand.rec.label}")
        zmq = ZmqClient(server.zmq_endpoint, timeout=30)
        ring = zmq.create_ring(8, image.nbytes)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)

        def via_zmq() -> list[str]:
            slot = zmq.acquire_slot(ring)
            result = zmq.infer("ocr", {"IMAGE": slot.write(image)}, ["TEXT"])
            return [t.decode() for t in result.as_numpy("TEXT")]

        def via_grpc() -> list[str]:
            tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
            tensor.set_data_from_numpy(image)
            return [t.decode() for t in grpc.infer("ocr", [tensor]).as_numpy("TEXT")]

        def zmq_window(seconds: float, inflight: int = 4) -> tuple[int, float]:
            end, done = time.monotonic() + seconds, 0
            start = time.perf_counter()
            futures = []
            while time.monotonic() < end or futures:
                while time.monotonic() < end and len(futures) < inflight:
                    slot = zmq.acquire_slot(ring)
                    futures.append(zmq.submit("ocr", {"IMAGE": slot.write(image)}, ["TEXT"]))
                texts = [t.decode() for t in futures.pop(0).result().as_numpy("TEXT")]
                if texts != expected:
                    raise SystemExit(f"zmq-shm x{inflight}: read {texts}, in-process read {expected}")
                done += 1
            return done, time.perf_counter() - start

        modes: dict[str, Callable[[], list[str]]] = {"inproc": lambda: by_hand(image), "zmq-shm": via_zmq,
                                                      "grpc": via_grpc}  # fmt: skip
        latencies: dict[str, list[float]] = {m: [] for m in (*modes, "zmq-shm x4")}
        windows: list[tuple[int, float]] = []
        for call in modes.values():  # warm-up
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                call()
        by_hand.stage_ns, by_hand.frames = dict.fromkeys(STEPS, 0), 0
        stage_rows: list[dict[str, dict[str, float]]] = []
        cpu = dict.fromkeys(latencies, 0.0)
        pid = server.process.pid
        for round_index in range(args.rounds):
            progress(f"round {round_index + 1}/{args.rounds}")
            for mode, call in modes.items():
                before = _stats(server.base) if mode == "zmq-shm" else None
                used = cpu_seconds(pid)
                run(mode, call, args.seconds, expected, latencies)
                cpu[mode] += cpu_seconds(pid) - used
                if before is not None:
                    stage_rows.append(_served_stages(before, _stats(server.base)))
            used = cpu_seconds(pid)
            windows.append(zmq_window(args.seconds))
            cpu["zmq-shm x4"] += cpu_seconds(pid) - used
        report(args, image, expected, latencies, windows, by_hand, stage_rows, cpu)
    finally:
        server.stop()
    return 0


def report(args: argparse.Namespace, image: np.ndarray, expected: list[str],
           latencies: dict[str, list[float]], windows: list[tuple[int, float]], by_hand: ByHand,
           stage_rows: list[dict[str, dict[str, float]]], cpu: dict[str, float]) -> None:  # fmt: skip
    rows = {}
    for mode, values in latencies.items():
        if mode == "zmq-shm x4":
            frames = sum(w[0] for w in windows)
            fps = frames / max(sum(w[1] for w in windows), 1e-9)
            rows[mode] = {"frames": frames, "fps": fps, "cpu_ms": cpu[mode] / max(frames, 1) * 1e3}
            continue
        rows[mode] = {"frames": len(values), "fps": len(values) / max(sum(values), 1e-9),
                      "p50_ms": percentile(values, 50) * 1e3,
                      "p99_ms": percentile(values, 99) * 1e3,
                      "cpu_ms": cpu[mode] / max(len(values), 1) * 1e3}  # fmt: skip
    print(f"\nOCR pipeline, {image.shape[1]}x{image.shape[0]} frame, reads {expected}")
    print(f"{'mode':<12} {'frames':>7} {'frames/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/frame':>13}")
    for mode, row in rows.items():
        print(f"{mode:<12} {row['frames']:>7} {row['fps']:>9.2f} {row.get('p50_ms', float('nan')):>8.1f} "
              f"{row.get('p99_ms', float('nan')):>8.1f} {row['cpu_ms']:>13.1f}")  # fmt: skip
    stages = {}
    for step in STEPS:
        inproc = by_hand.stage_ns[step] / max(by_hand.frames, 1) / 1e6
        step_ms = float(np.mean([r[step]["step_ms"] for r in stage_rows])) if stage_rows else float("nan")
        compute = float(np.mean([r[step]["compute_ms"] for r in stage_rows])) if stage_rows else float("nan")
        stages[step] = {"inproc_ms": inproc, "served_step_ms": step_ms, "served_compute_ms": compute}
    print(f"\n{'stage':<11} {'in-process ms':>14} {'served step ms':>15} {'of which compute':>17}")
    for step, row in stages.items():
        served = f"{row['served_step_ms']:>15.1f} {row['served_compute_ms']:>17.1f}"
        print(f"{step:<11} {row['inproc_ms']:>14.1f} {served}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_facts(), "size": list(image.shape), "text": expected,
                                    "modes": rows, "stages": stages}, indent=1))  # fmt: skip
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
