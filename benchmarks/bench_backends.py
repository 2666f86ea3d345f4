"""Backends side by side on this machine (issue 5): each sample model on every available backend/precision,
throughput and p50 latency, error vs ONNX Runtime fp32, and the runtime plan's choice marked.

    python -m edgeserve samples            # once: models/mlp, ppocr_det, ppocr_cls, ppocr_rec
    python benchmarks/bench_backends.py [--seconds 3] [--iterations 300] [--models mlp,ppocr_det]
    python benchmarks/bench_backends.py --render benchmarks/results/backends.json   # table of a past run

One process, options run back to back per model (the machine is noisy: compare ratios within a run).
Every option runs one request at a time on one instance with the plan's thread budget for one instance
(the whole box), so rows compare runtimes, not instance layouts. The plan is computed for each model's
config with any backend/platform pin removed (the sample configs carry none now), so the mark shows
what the device profile + accuracy guard pick on their own; its own instance x thread layout is printed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from common import bench_parser, machine_facts  # noqa: E402

from edgeserve.backends.base import BackendOptions, get_backend  # noqa: E402
from edgeserve.config import load_settings  # noqa: E402
from edgeserve.hardware.selector import PlanSelector  # noqa: E402
from edgeserve.repository.config import ModelConfig, parse_pbtxt  # noqa: E402

# representative request shapes (the PP-OCR configs' own warm-up sizes)
SHAPES = {
    "mlp": (1, 16),
    "ppocr_det": (1, 3, 640, 640),
    "ppocr_cls": (1, 3, 48, 192),
    "ppocr_rec": (1, 3, 48, 320),
}


def options_here(threads: int, bf16: bool) -> list[tuple[str, str]]:
    opts = [("onnxruntime", "fp32"), ("openvino", "fp32")]
    if bf16:
        opts.append(("openvino", "bf16"))
    return opts


def measure(
    instance: Any, feed: dict[str, np.ndarray], seconds: float, iterations: int
) -> tuple[float, float, int]:
    for _ in range(3):
        instance.infer(feed)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iterations and time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        instance.infer(feed)
        times.append(time.perf_counter() - t0)
    total = sum(times)
    return len(times) / total, statistics.median(times) * 1e3, len(times)


def verdicts(plan: Any) -> dict[tuple[str, str], str]:
    """(backend, precision) -> the plan's word on it, short: chosen / guard rejects / rejected / fallback."""
    out: dict[tuple[str, str], str] = {}
    for v in plan.verdicts:
        key = (v.option.backend, v.option.precision)
        if v is plan.chosen:
            out[key] = "chosen"
        elif v.ok:
            out[key] = "fallback"
        elif v.reason.startswith("accuracy guard"):
            out[key] = "guard rejects (" + v.reason.split("error ", 1)[-1].split(" ", 1)[0] + ")"
        elif not v.checked:
            out[key] = "not tried (after the choice)"
        else:
            out[key] = "rejected: " + v.reason.split(":", 1)[0]
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model (input) | backend / precision | calls/s | p50 ms | error vs ORT fp32 | plan |",
        "|---|---|---:|---:|---:|---|",
    ]
    previous = ""
    for r in rows:
        model = f"{r['model']} {list(SHAPES[r['model']])}" if r["model"] != previous else ""
        previous = r["model"]
        verdict = r.get("verdict", "")
        plan = "**✔ chosen**" if r["plan"] else verdict
        lines.append(f"| {model} | {r['backend']} {r['precision']} | {r['per_s']:,.1f} | {r['p50_ms']:.3f} | "
                     f"{r['rel_error']:.1e} | {plan} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repository", type=Path, default=ROOT / "models")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--seconds", type=float, default=3.0, help="time budget per option")
    parser.add_argument("--iterations", type=int, default=300, help="max timed calls per option")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "backends.json")
    parser.add_argument("--render", type=Path, help="print the markdown table of a saved run and exit")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(saved.get("facts", saved.get("machine", "")))
        for line in saved.get("plans", []):
            print(line)
        print(markdown(saved["rows"]))
        return 0

    settings = load_settings()  # as `edgeserve run` here: defaults + EDGESERVE_* environment
    settings.server.state_dir = ROOT / "models" / ".cache"  # accuracy guard cache (git-ignored)
    selector = PlanSelector(settings)
    hw = selector.hardware
    threads = selector.planner.threads()[0]
    facts = machine_facts()
    print(facts, flush=True)
    print(f"machine: {hw.cpu.summary()}; profile {selector.profile.name}; {threads} threads", flush=True)
    rows: list[dict[str, Any]] = []
    plans: list[str] = []
    for name in args.models.split(","):
        version_dir = args.repository / name / "1"
        path = version_dir / "model.onnx"
        if not path.exists():
            print(f"{name}: {path} missing; run `python -m edgeserve samples` first", flush=True)
            continue
        config_path = args.repository / name / "config.pbtxt"
        config = parse_pbtxt(config_path) if config_path.exists() else ModelConfig()
        unpinned = ModelConfig()
        unpinned.CopyFrom(config)
        unpinned.ClearField("backend")
        unpinned.ClearField("platform")
        plan = selector.plan(name, version_dir, unpinned)
        chosen = (plan.chosen.option.backend, plan.chosen.option.precision) if plan.chosen else None
        guard = [v.reason for v in plan.verdicts if v.reason.startswith("accuracy guard")]
        layout = (
            f"{sum(max(int(g.count), 1) for g in config.instance_group) or 1} instance(s) x "
            f"{plan.options.threads if plan.options else '?'} thread(s)"
        )
        plans.append(f"{name}: plan -> {chosen}, {layout} ({'; '.join(guard) or 'no guard needed'})")
        print(plans[-1], flush=True)
        said = verdicts(plan)
        x = np.random.default_rng(0).random(SHAPES[name], dtype=np.float32)
        reference: list[np.ndarray] | None = None
        for backend_name, precision in options_here(threads, hw.cpu.bf16):
            backend = get_backend(backend_name)
            instance = backend.load(
                path, config, BackendOptions(device="CPU", precision=precision, threads=threads)
            )
            feed = {instance.io.inputs[0].name: x}
            outputs = instance.infer(feed)
            values = [outputs[t.name] for t in instance.io.outputs]
            if reference is None:
                reference = values
            error = max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(a))), 1e-12)
                        for a, b in zip(reference, values, strict=True))  # fmt: skip
            per_s, p50, n = measure(instance, feed, args.seconds, args.iterations)
            instance.close()
            mark = "<- plan" if chosen == (backend_name, precision) else ""
            print(f"  {backend_name:12} {precision:5} {per_s:9.1f}/s  p50 {p50:8.3f} ms  n={n:4d}  "
                  f"max rel err vs ORT fp32 {error:.1e} {mark}", flush=True)  # fmt: skip
            rows.append({"model": name, "backend": backend_name, "precision": precision, "per_s": per_s,
                         "p50_ms": p50, "n": n, "rel_error": error, "plan": bool(mark),
                         "verdict": said.get((backend_name, precision), "")})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    saved = {"machine": hw.cpu.summary(), "facts": facts, "threads": threads, "plans": plans, "rows": rows}
    args.out.write_text(json.dumps(saved, indent=1))
    print()
    print(markdown(rows))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
