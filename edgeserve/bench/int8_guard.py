"""The INT8 accuracy guard: the fp32 model and an INT8 candidate on the held-out rows (never calibrated
on), in this process. Per output, fidelity.py's scale-aware figures; for score-shaped outputs ([N, C],
C > 1) the strict top-1 agreement (the same argmax, no near-tie allowance). A candidate is kept only
when every score output agrees on at least `min_top1` of the rows and every output's RMS error stays
within `max_error` of its range (and nothing overflows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.bench.calibration import Feed
from edgeserve.hardware import fidelity

Outputs = list[Any]
Run = Callable[[Feed], Outputs]
MIN_TOP1 = 0.99
MAX_ERROR = 0.05


@dataclass(frozen=True)
class Thresholds:
    min_top1: float = MIN_TOP1
    max_error: float = MAX_ERROR


@dataclass
class Verdict:
    ok: bool
    reason: str
    rows: int
    top1: dict[str, float] = field(default_factory=dict)
    figures: list[fidelity.OutputFigures] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "rows": self.rows, "top1": self.top1,
                "figures": [f.to_dict() for f in self.figures]}  # fmt: skip


def ort_runner(path: Path) -> tuple[Run, list[str]]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return (lambda feed: list(session.run(None, feed))), names


def openvino_runner(path: Path) -> tuple[Run, list[str]]:
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    names = []
    for i, port in enumerate(compiled.outputs):
        try:
            names.append(str(port.get_any_name()))
        except RuntimeError:
            names.append(f"output{i}")

    def run(feed: Feed) -> Outputs:
        result = compiled(feed)
        return [np.asarray(result[port]) for port in compiled.outputs]

    return run, names


def runner(path: Path) -> tuple[Run, list[str]]:
    return openvino_runner(path) if path.suffix == ".xml" else ort_runner(path)


def _strict_top1(refs: Sequence[Any], outs: Sequence[Any]) -> tuple[int, int]:
    agree = total = 0
    for ref, out in zip(refs, outs, strict=True):
        ref, out = np.asarray(ref), np.asarray(out)
        rows_r, rows_o = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, ref.shape[-1])
        agree += int(np.count_nonzero(rows_r.argmax(axis=1) == rows_o.argmax(axis=1)))
        total += len(rows_r)
    return agree, total


def judge(reference: Sequence[Outputs], candidate: Sequence[Outputs], names: Sequence[str],
          limits: Thresholds) -> Verdict:  # fmt: skip
    """The verdict on outputs already computed (reference[i][k]: fp32's output k for held-out row i)."""
    top1: dict[str, float] = {}
    figures: list[fidelity.OutputFigures] = []
    for k, name in enumerate(names):
        refs, outs = [r[k] for r in reference], [c[k] for c in candidate]
        figure = fidelity.compare(name, refs, outs)
        figures.append(figure)
        if figure.top1 is not None and not figure.nonfinite and figure.range_error != float("inf"):
            agree, total = _strict_top1(refs, outs)  # score-shaped: a classifier's answer is its argmax
            top1[name] = agree / total if total else 1.0
    return verdict(figures, top1, len(reference), limits)


def verdict(figures: Sequence[fidelity.OutputFigures], top1: dict[str, float], rows: int,
            limits: Thresholds) -> Verdict:  # fmt: skip
    problems: list[str] = []
    for figure in figures:
        name = figure.name
        if figure.nonfinite:
            problems.append(f"{name}: {figure.nonfinite} non-finite values where fp32 is finite")
        elif figure.range_error == float("inf"):
            problems.append(f"{name}: another shape than fp32")
        else:
            if name in top1 and top1[name] < limits.min_top1:
                problems.append(f"{name}: top-1 agreement {top1[name]:.1%} on {rows} held-out rows "
                                f"< {limits.min_top1:.1%}")  # fmt: skip
            if figure.range_error > limits.max_error:
                problems.append(f"{name}: RMS error {figure.range_error:.2%} of the output's range > "
                                f"{limits.max_error:.2%}")  # fmt: skip
    if problems:
        return Verdict(False, "; ".join(problems), rows, dict(top1), list(figures))
    text = ", ".join(f"top-1 {v:.1%}" for v in top1.values())
    if figures:
        text = (text + ", " if text else "") + (
            f"RMS error {max(f.range_error for f in figures):.2%} of range, "
            f"cosine {min(f.cosine for f in figures):.5f}"
        )
    return Verdict(True, f"{text or 'no outputs'} on {rows} held-out rows", rows, dict(top1), list(figures))


def judge_figures(stored: dict[str, Any], limits: Thresholds) -> dict[str, Any]:
    """A stored verdict (Verdict.to_dict) judged again against `limits`, without running anything."""
    try:
        figures = fidelity.from_dicts(stored["figures"])
        again = verdict(figures, dict(stored.get("top1") or {}), int(stored["rows"]), limits)
    except (KeyError, TypeError, ValueError, AttributeError):
        return {"ok": False, "reason": "unreadable earlier verdict"}
    return again.to_dict()


def check(fp32: Path, candidate: Path, held_out: Sequence[Feed], limits: Thresholds) -> Verdict:
    """Run both models on the held-out rows and judge the candidate."""
    run_ref, names = ort_runner(fp32)
    reference = [run_ref(feed) for feed in held_out]
    try:  # a quantizer can write a model its runtime refuses: that candidate is rejected, not the tune
        run_cand, _ = runner(candidate)
        outputs = [run_cand(feed) for feed in held_out]
    except Exception as exc:
        engine = "OpenVINO" if candidate.suffix == ".xml" else "ONNX Runtime"
        text = " ".join(str(exc).split())
        text = text if len(text) <= 240 else "..." + text[-237:]  # the runtime's reason is at the end
        return Verdict(False, f"{engine} does not run it ({type(exc).__name__}: {text})", len(held_out))
    return judge(reference, outputs, names, limits)
