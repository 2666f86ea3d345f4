"""How close a lower precision's outputs are to fp32: scale-aware figures per output, and the verdict.

Per output, over every sample, relative to the output's range (max - min of fp32; 1 for an output
whose values all lie in [0, 1], the scale of a probability, so a detection map that is near zero
everywhere on random inputs is not judged on the noise of its last digits):
- range error: RMS(candidate - fp32) / range; judged against the tolerance. RMS, so one pixel on a
  sigmoid's steep edge does not decide alone;
- worst error: max |candidate - fp32| / range; judged at 10x the tolerance (right on average but
  badly wrong somewhere);
- cosine similarity of the flattened outputs; judged (>= 1 - tolerance) where the output carries a
  signal (RMS of fp32 >= 1% of the range), not on an all-but-zero map;
- top-1 agreement for score-shaped outputs ([N, C] with C > 1, or rows that are probabilities): the
  share of rows whose candidate argmax is, in fp32, within 5% of the range of the fp32 best (a near
  tie may flip, a real disagreement may not). For these it replaces the range and worst errors in
  the verdict: a classifier is right when it picks the same class.
A non-finite value where fp32 is finite (fp16 overflow) fails at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
WORST_FACTOR = 10.0  # the worst single element may be this many tolerances off
TIE = 0.05  # top-1: a candidate's pick this close (share of the range) to the fp32 best agrees


@dataclass(frozen=True)
class OutputFigures:
    name: str
    range_error: float  # RMS error / range
    worst_error: float  # max abs error / range
    cosine: float
    top1: float | None = None  # share of rows whose argmax agrees (up to near ties); None: not scores
    nonfinite: int = 0  # non-finite candidate values where fp32 is finite
    signal: bool = True  # False: fp32 is all but zero on these inputs (cosine not judged)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        parts = [
            f"range err {self.range_error:.1e}",
            f"worst {self.worst_error:.1e}",
            f"cos {self.cosine:.5f}",
        ]
        if self.top1 is not None:
            parts.append(f"top-1 {self.top1:.1%}")
        if self.nonfinite:
            parts.append(f"{self.nonfinite} non-finite")
        if not self.signal:
            parts.append("near-zero output")
        return f"{self.name}: " + ", ".join(parts)


def _scores_shaped(ref: Array) -> bool:
    if ref.ndim == 2 and ref.shape[1] > 1:
        return True
    if ref.ndim >= 2 and ref.shape[-1] > 1 and ref.size:
        sums = ref.sum(axis=-1)
        return bool(np.all(ref >= -1e-6) and np.allclose(sums, 1.0, atol=1e-2))
    return False


def _flat(arrays: Sequence[Array]) -> Array:
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def compare(name: str, refs: Sequence[Array], outs: Sequence[Array], tie: float = TIE) -> OutputFigures:
    """Figures for one output over all samples (refs[i] is fp32's answer to sample i); the verdict
    is judge()'s, so a cached measurement can be judged against another tolerance."""
    if any(np.shape(r) != np.shape(o) for r, o in zip(refs, outs, strict=True)):
        return OutputFigures(name, math.inf, math.inf, 0.0)
    if not refs or all(np.size(r) == 0 for r in refs):
        return OutputFigures(name, 0.0, 0.0, 1.0)
    ref, out = _flat(refs), _flat(outs)
    finite = np.isfinite(ref)
    nonfinite = int(np.count_nonzero(finite & ~np.isfinite(out)))
    ref, out = ref[finite], out[finite]
    if nonfinite or ref.size == 0:
        return OutputFigures(name, math.inf, math.inf, 0.0, None, nonfinite)
    low, high = float(ref.min()), float(ref.max())
    span = 1.0 if low >= 0.0 and high <= 1.0 else (high - low) or max(abs(high), 1e-12)
    diff = np.abs(out - ref)
    norms = float(np.linalg.norm(ref) * np.linalg.norm(out))
    cosine = float(np.dot(ref, out) / norms) if norms > 0 else (1.0 if not diff.any() else 0.0)
    top1 = None
    shaped = [np.asarray(r, dtype=np.float64) for r in refs]
    if all(_scores_shaped(r) for r in shaped):
        agree = total = 0
        for r, o in zip(shaped, outs, strict=True):
            rows_r = r.reshape(-1, r.shape[-1])
            rows_o = np.asarray(o, dtype=np.float64).reshape(-1, r.shape[-1])
            picked = rows_r[np.arange(len(rows_r)), rows_o.argmax(axis=1)]
            agree += int(np.count_nonzero(rows_r.max(axis=1) - picked <= tie * span))
            total += len(rows_r)
        top1 = agree / total if total else 1.0
    signal = float(np.sqrt(np.mean(ref**2))) >= 0.01 * span
    return OutputFigures(
        name,
        float(np.sqrt(np.mean(diff**2))) / span,
        float(diff.max()) / span,
        cosine,
        top1,
        0,
        signal,
    )


def problem(f: OutputFigures, tolerance: float) -> str | None:
    """Why this output fails `tolerance`, or None when it passes."""
    if f.nonfinite:
        return f"{f.name}: {f.nonfinite} non-finite values where fp32 is finite (overflow)"
    if math.isinf(f.range_error):
        return f"{f.name}: another shape than fp32"
    if f.signal and f.cosine < 1.0 - tolerance:
        return f"{f.name}: cosine {f.cosine:.6f} < {1.0 - tolerance:g}"
    if f.top1 is not None:
        if f.top1 < 1.0 - tolerance:
            return f"{f.name}: top-1 agreement {f.top1:.1%} < {1.0 - tolerance:.1%}"
        return None
    if f.range_error > tolerance:
        return f"{f.name}: range error {f.range_error:.1e} > {tolerance:g}"
    if f.worst_error > WORST_FACTOR * tolerance:
        return f"{f.name}: worst error {f.worst_error:.1e} > {WORST_FACTOR * tolerance:g}"
    return None


def judge(figures: Sequence[OutputFigures], tolerance: float) -> tuple[bool, str]:
    """(passes, why) for a candidate's figures against `tolerance` (e.g. 0.01 = 1% of the range)."""
    problems = [p for p in (problem(f, tolerance) for f in figures) if p]
    if problems:
        return False, "; ".join(problems)
    return True, summary(figures)


def summary(figures: Sequence[OutputFigures]) -> str:
    """The worst figures over all outputs, one short phrase (for plan reasons and tables)."""
    if not figures:
        return "no outputs"
    text = (
        f"range err {max(f.range_error for f in figures):.1e}, "
        f"worst {max(f.worst_error for f in figures):.1e}, cos {min(f.cosine for f in figures):.5f}"
    )
    tops = [f.top1 for f in figures if f.top1 is not None]
    if tops:
        text += f", top-1 {min(tops):.1%} (scores: judged on top-1 and cosine)"
    return text


def from_dicts(items: Any) -> list[OutputFigures]:
    """OutputFigures from a cache entry (raises on a malformed one)."""
    return [OutputFigures(**{k: v for k, v in item.items() if k in _FIELDS}) for item in items]


_FIELDS = set(OutputFigures.__dataclass_fields__)
