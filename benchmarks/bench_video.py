"""Camera pipelines (issue 24): N live 720p H.264 streams at 30 fps into the CenterFace detector and
into the OCR pipeline, `edgeserve watch`'s pipeline against the same pipeline written by hand as a
user would today (PyAV decode + tritonclient gRPC to edgeserve), side by side in one run.

    python benchmarks/bench_video.py                        # 1, 4, 8 streams x {centerface, ocr}, 2 rounds
    python benchmarks/bench_video.py --seconds 5 --streams 1,8 --models centerface --rounds 3

The streams: one 10 s clip encoded here (1280x720, 30 fps, libx264 `veryfast` + `zerolatency`: no
B-frames, as IP cameras send) with a face and a line of text, played in real time and in a loop
per stream (a camera stand-in: each packet is released at its time and decoded at once). Both
pipelines decode every frame of every stream (a live stream must be read) with the same settings
(one FFmpeg thread per stream, the same pacing), run in this process, keep the newest frame when
inference lags (the latest-frame policy) and talk to the same `edgeserve serve` on loopback:

    watch   edgeserve.video.Watch, latest-frame policy: decoder threads convert the frame to be
            sent into a shared-memory ring slot (CenterFace: 640x384 CHW UINT8; OCR: 1280x720 HWC UINT8),
            ZeroMQ, its default requests in flight (2 for one stream, 1 per stream for several),
            results decoded to boxes/text
    watch-1 the same with 1 request in flight (for the latency it adds above the model's time)
    hand    per stream, a decoder thread keeping the newest frame (the usual "grabber" for live
            streams) and an inference thread: PyAV's `to_ndarray(format="rgb24", width, height)`
            and numpy for the model's layout, tritonclient gRPC `infer` (one request at a time,
            all outputs, as tritonclient asks by default), the same result decoding

Columns: frames inferred and dropped per second (all streams), decode-to-result latency p50/p99,
CPU per frame: decode (FFmpeg's demuxer and decoder, per decoded frame), convert (per inferred
frame), other client work (this process's CPU less decode and convert, per inferred frame: the
hand-off of every decoded frame, transport, result decoding), "above" = convert + other (the
client's CPU per inferred frame above decode and model: issue 24's first target), the server's
CPU per inferred frame (model + serving) and the model's own backend time (wall time of the
executed batches, all steps of the OCR ensemble, per frame), and this process's CPU share.
The pipelines take turns per cell, in alternating order, for --rounds rounds (A B, B A, ...);
the ratio lines give every round's watch / hand frames/s. JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_flags, machine_facts, percentile, progress

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "video"))
MODELS = ROOT / "models"
FPS = 30


def make_clip(path: Path, seconds: int, size: tuple[int, int]) -> Path:
    import av
    from PIL import Image, ImageDraw, ImageFont
    from video_clips import OCR_TEXT, portrait

    width, height = size
    face = portrait(height // 2)
    font = ImageFont.load_default(size=height // 12)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "tune": "zerolatency", "g": str(FPS * 2)}
        for index in range(seconds * FPS):
            image = Image.new("RGB", size, (70, 90, 110))
            image.paste(Image.fromarray(face), ((index * 6) % (width - face.shape[1]), height // 8))
            ImageDraw.Draw(image).text((width // 10, height * 3 // 4), OCR_TEXT, fill="white", font=font)
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


class Meter:
    """This process's and the server's CPU, and the server's backend time, between two reads."""

    def __init__(self, server_pid: int, http: str) -> None:
        import psutil

        self.server = psutil.Process(server_pid)
        self.http = http
        self.model = "centerface"  # whose batches are counted (the OCR ensemble's: its detector's)

    def read(self) -> dict[str, float]:
        server = 0.0
        for process in (self.server, *self.server.children(recursive=True)):
            try:
                times = process.cpu_times()
                server += times.user + times.system
            except Exception:
                continue
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=30) as response:
            text = response.read().decode()
        # per executed batch (Triton's nv_inference_compute_infer_duration_us counts a batch once per request)
        pattern = r"^edgeserve_compute_infer_duration_seconds_sum\{[^}]*\} (\S+)$"
        compute = sum(float(v) for v in re.findall(pattern, text, re.M)) * 1e6
        counts = {
            key: sum(
                float(v) for v in re.findall(rf'^{metric}\{{model="{self.model}"[^}}]*\}} (\S+)$', text, re.M)
            )
            for key, metric in (("batches", "nv_inference_exec_count"), ("requests", "nv_inference_count"))
        }
        return {
            "wall": time.perf_counter(),
            "client": time.process_time(),
            "server": server,
            "compute_us": compute,
            **counts,
        }


class Stats:
    """What one pipeline reports over the measured window (shared shape for both)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.inferred = 0
        self.decoded = 0
        self.decode_cpu = 0.0
        self.convert_cpu = 0.0
        self.counting = False

    def result(self, latency: float) -> None:
        with self.lock:
            if self.counting:
                self.inferred += 1
                self.latencies.append(latency)


def run_watch(
    clip: Path,
    streams: int,
    model: str,
    endpoint: str,
    seconds: float,
    warm: float,
    meter: Meter,
    inflight: int = 0,
) -> dict[str, Any]:
    from edgeserve.video import SourceOptions, Watch, WatchOptions, parse_sources

    stats = Stats()
    options = WatchOptions(
        model=model,
        endpoint=endpoint,
        policy="latest",
        timeout=60,
        inflight=inflight,
        source=SourceOptions(realtime=True, loop=True, decoder_threads=1),
    )
    sources = parse_sources([f"s{i}={clip}" for i in range(streams)])
    watch = Watch(sources, options, on_result=lambda r: stats.result(r.latency_ms / 1e3))
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    time.sleep(warm)

    def totals() -> tuple[int, float, float]:
        return (
            sum(s.thread.counters.decoded for s in watch.streams),
            sum(s.thread.counters.decode_cpu_s for s in watch.streams),
            sum(s.convert_cpu_s for s in watch.streams),
        )

    def finish() -> None:
        watch.stop()
        thread.join(120)

    return _measure(stats, meter, seconds, totals, finish)


def run_hand(
    clip: Path, streams: int, model: str, grpc_url: str, seconds: float, warm: float, meter: Meter
) -> dict[str, Any]:
    """The hand-written pipeline: what a user writes today with PyAV and tritonclient."""
    import av
    import tritonclient.grpc as grpcclient

    from edgeserve.protocol.datatypes import numpy_dtype
    from edgeserve.video.convert import InputSpec
    from edgeserve.video.results import interpret

    stats = Stats()
    stop = threading.Event()
    spec = InputSpec.from_metadata(
        grpcclient.InferenceServerClient(grpc_url).get_model_metadata(model, as_json=True)
    )
    counters = [{"decoded": 0, "cpu": 0.0, "convert": 0.0} for _ in range(streams)]

    def grabber(index: int, latest: list[Any], ready: threading.Condition) -> None:
        """The usual live-stream grabber, paced like the watch's sources: each packet at its time."""
        while not stop.is_set():
            with av.open(str(clip)) as container:
                video = container.streams.video[0]
                video.codec_context.thread_count = 1  # as in the watch run: its CPU is this thread's
                start, base, first = time.perf_counter(), float(video.time_base), None
                cpu = time.thread_time()  # demuxing and decoding count as decode, as in the watch
                for packet in container.demux(video):
                    if packet.dts is not None:
                        first = packet.dts if first is None else first
                        counters[index]["cpu"] += time.thread_time() - cpu
                        wait = start + (packet.dts - first) * base - time.perf_counter()
                        if wait > 0 and stop.wait(wait):
                            return
                        cpu = time.thread_time()
                    frames = packet.decode()
                    counters[index]["cpu"] += time.thread_time() - cpu
                    for frame in frames:
                        counters[index]["decoded"] += 1
                        with ready:
                            latest[0] = (frame, time.perf_counter())
                            ready.notify()
                    if stop.is_set():
                        return
                    cpu = time.thread_time()

    def infer_loop(index: int, latest: list[Any], ready: threading.Condition) -> None:
        client = grpcclient.InferenceServerClient(grpc_url)
        while not stop.is_set():
            with ready:
                while latest[0] is None and not stop.is_set():
                    ready.wait(0.5)
                item, latest[0] = latest[0], None
            if item is None:
                continue
            frame, t0 = item
            cpu = time.thread_time()
            width, height = spec.size_for(frame.width, frame.height)
            rgb = frame.to_ndarray(format="rgb24", width=width, height=height)  # what PyAV's docs show
            # the layout and type the model's metadata asks for (CenterFace: [1,3,H,W] UINT8)
            image = rgb.transpose(2, 0, 1) if spec.layout == "CHW" else rgb
            dtype = numpy_dtype(spec.datatype)
            tensor = np.ascontiguousarray(image[None] if spec.batch else image, dtype=dtype)
            counters[index]["convert"] += time.thread_time() - cpu
            request = grpcclient.InferInput(spec.name, list(tensor.shape), spec.datatype)
            request.set_data_from_numpy(tensor)
            reply = client.infer(model, [request])
            names = [o.name for o in reply.get_response().outputs]
            interpret({n: reply.as_numpy(n) for n in names}, (width, height), (frame.width, frame.height))
            stats.result(time.perf_counter() - t0)
        client.close()

    threads = []
    for index in range(streams):
        latest: list[Any] = [None]
        ready = threading.Condition()
        threads += [
            threading.Thread(target=grabber, args=(index, latest, ready), daemon=True),
            threading.Thread(target=infer_loop, args=(index, latest, ready), daemon=True),
        ]
    for thread in threads:
        thread.start()
    time.sleep(warm)

    def totals() -> tuple[int, float, float]:
        return (
            sum(int(c["decoded"]) for c in counters),
            sum(c["cpu"] for c in counters),
            sum(c["convert"] for c in counters),
        )

    def finish() -> None:
        stop.set()
        for thread in threads:
            thread.join(120)

    return _measure(stats, meter, seconds, totals, finish)


def _measure(
    stats: Stats,
    meter: Meter,
    seconds: float,
    totals: Callable[[], tuple[int, float, float]],
    finish: Callable[[], object],
) -> dict[str, Any]:
    before, (decoded0, decode0, convert0) = meter.read(), totals()
    with stats.lock:
        stats.counting = True
    time.sleep(seconds)
    with stats.lock:
        stats.counting = False
    after, (decoded1, decode1, convert1) = meter.read(), totals()
    finish()
    wall = after["wall"] - before["wall"]
    inferred = max(stats.inferred, 1)
    decoded = decoded1 - decoded0
    decode_cpu, convert_cpu = decode1 - decode0, convert1 - convert0
    client = after["client"] - before["client"]
    return {
        "inferred_per_s": stats.inferred / wall,
        "dropped_per_s": max(0, decoded - stats.inferred) / wall,
        "p50_ms": percentile(stats.latencies, 50) * 1e3,
        "mean_ms": float(np.mean(stats.latencies)) * 1e3 if stats.latencies else float("nan"),
        "p99_ms": percentile(stats.latencies, 99) * 1e3,
        "decode_ms": decode_cpu / max(decoded, 1) * 1e3,
        "convert_ms": convert_cpu / inferred * 1e3,
        "other_ms": (client - decode_cpu - convert_cpu) / inferred * 1e3,
        "server_ms": (after["server"] - before["server"]) / inferred * 1e3,
        # everything the box spent per inferred frame, dropped frames' decoding included
        "total_ms": (client + after["server"] - before["server"]) / inferred * 1e3,
        "model_ms": (after["compute_us"] - before["compute_us"]) / inferred / 1e3,
        "client_cpu_share": client / wall,
        "batch": (after["requests"] - before["requests"]) / max(after["batches"] - before["batches"], 1),
        "inferred": stats.inferred,
        "decoded": decoded,
    }


# the SIMD flags that matter to decoding, swscale and the model runtimes
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


def served_by(server: Any) -> str:
    """What the runtime plan chose for each model (the server's 'ready in' log lines)."""
    found = re.findall(r"model (\S+) version \S+ ready in \S+ (backend=.*)", server.log())
    return "; ".join(f"{name}: {how}" for name, how in found if name in ("centerface", "ppocr_det"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell and pipeline")
    parser.add_argument("--warm", type=float, default=3.0, help="unmeasured seconds first")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--models", default="centerface,ocr")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every pipeline per cell")
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_video.json")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    counts = [int(n) for n in args.streams.split(",")]
    models = args.models.split(",")
    print(machine_facts())
    print(f"CPU flags: {cpu_flags(FLAGS)}")
    from es_server import start_server

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"encoding a 10 s {width}x{height} {FPS} fps H.264 clip")
        clip = make_clip(Path(tmp) / "camera.mkv", 10, (width, height))
        progress(f"starting edgeserve serve ({', '.join(models)})")
        load = [a for m in models for a in ("--load-model", m)]
        server = start_server(MODELS, Path(tmp), args=[*load, "--log-level", "INFO"], timeout=300)
        served = served_by(server)
        try:
            meter = Meter(server.process.pid, server.base)
            per_round = sum(3 if n == 1 else 2 for n in counts)
            total = len(models) * per_round * args.rounds
            for model in models:
                meter.model = "ppocr_det" if model == "ocr" else model
                for streams in counts:
                    names = ["watch", "watch-1", "hand"] if streams == 1 else ["watch", "hand"]
                    for turn in range(args.rounds):
                        for name in names if turn % 2 == 0 else names[::-1]:
                            progress(f"[{len(rows) + 1}/{total}] {model}, {streams} stream(s), {name} ...")
                            if name.startswith("watch"):
                                inflight = 1 if name == "watch-1" else 0
                                row = run_watch(
                                    clip, streams, model, server.zmq_endpoint, args.seconds, args.warm, meter,
                                    inflight,
                                )  # fmt: skip
                            else:
                                row = run_hand(
                                    clip, streams, model, server.grpc_url, args.seconds, args.warm, meter
                                )
                            row.update(model=model, streams=streams, pipeline=name, round=turn + 1)
                            row["load"] = os.getloadavg()[0]
                            rows.append(row)
                            progress(
                                f"    {row['inferred_per_s']:.1f} inferred/s, p50 {row['p50_ms']:.0f} ms, "
                                f"above decode+model {row['convert_ms'] + row['other_ms']:.2f} ms/frame"
                            )
        finally:
            server.stop()
    report(rows, models, counts, served)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_facts(), "served": served, "rows": rows}, indent=2))
    return 0


def report(rows: list[dict[str, Any]], models: list[str], counts: list[int], served: str) -> None:
    print(f"served: {served}")
    print()
    print(
        "| model | streams | pipeline | round | inferred/s | dropped/s | latency p50 / p99 ms "
        "| decode ms/frame | convert ms/frame | other client ms/frame | above decode+model ms/frame "
        "| server CPU ms/frame | all CPU ms/frame | model ms/frame | mean batch | client CPU | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            r["model"], r["streams"], r["pipeline"], r["round"], f"{r['inferred_per_s']:.1f}",
            f"{r['dropped_per_s']:.1f}", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}", f"{r['decode_ms']:.2f}",
            f"{r['convert_ms']:.2f}", f"{r['other_ms']:.2f}", f"{r['convert_ms'] + r['other_ms']:.2f}",
            f"{r['server_ms']:.1f}", f"{r['total_ms']:.1f}", f"{r['model_ms']:.1f}", f"{r['batch']:.1f}",
            f"{r['client_cpu_share'] * 100:.0f}%", f"{r['load']:.1f}",
        ]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    for model in models:
        for streams in counts:
            cell = [r for r in rows if r["model"] == model and r["streams"] == streams]
            ratios, bound = [], []
            for turn in sorted({r["round"] for r in cell}):
                pair = {r["pipeline"]: r for r in cell if r["round"] == turn}
                if pair.get("hand", {}).get("inferred_per_s") and "watch" in pair:
                    ratios.append(pair["watch"]["inferred_per_s"] / pair["hand"]["inferred_per_s"])
                    bound.append(pair["hand"]["total_ms"] / pair["watch"]["total_ms"])
            if ratios:
                each = ", ".join(f"{x:.2f}x" for x in ratios)
                median = _median(ratios)
                # With the box's CPU the limit, frames/s = cores / CPU per frame: the ratio a pipeline
                # can reach is the hand-written one's CPU per frame (server + client) over its own.
                cpu_bound = ", ".join(f"{x:.2f}x" for x in bound)
                print(f"{model}, {streams} stream(s): watch / hand frames/s = {each} (median {median:.2f}x); "
                      f"CPU per frame, hand / watch (what a CPU-bound box allows) = {cpu_bound}")  # fmt: skip
        for name in ("watch", "hand"):
            above = _one_stream(rows, model, name, lambda r: r["convert_ms"] + r["other_ms"])
            if above:
                each = ", ".join(f"{x:.2f}" for x in above)
                print(
                    f"{model}, 1 stream, {name}: client CPU per frame above decode + model = {each} ms "
                    f"(median {_median(above):.2f})"
                )
        if model == "ocr":  # an ensemble's steps overlap and include Python steps: no backend baseline
            continue
        for name in ("watch-1", "hand"):
            extra = _one_stream(rows, model, name, lambda r: r["mean_ms"] - r["model_ms"])
            if extra:
                each = ", ".join(f"{x:.1f}" for x in extra)
                print(
                    f"{model}, 1 stream, 1 frame in flight, {name}: decode-to-result latency above the "
                    f"model's backend time = {each} ms (mean)"
                )


def _one_stream(
    rows: list[dict[str, Any]], model: str, pipeline: str, value: Callable[[dict[str, Any]], float]
) -> list[float]:
    """`value` of each round of `model` with one stream through `pipeline`."""
    return [value(r) for r in rows if r["model"] == model and r["streams"] == 1 and r["pipeline"] == pipeline]


def _median(values: list[float]) -> float:
    return float(np.median(values))


if __name__ == "__main__":
    sys.exit(main())
