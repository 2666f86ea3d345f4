"""`tune`'s accuracy check: a candidate's outputs, served, against the fp32 reference's.

Per output: the worst error over the output's scale, the lowest cosine similarity, and top-1
agreement on the last axis (classifiers). The reference is the first fp32 candidate's outputs,
kept in the out dir so a resumed run checks against the same figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.bench.inputs import ModelInfo, make_samples, parse_shape_flags, resolve_shapes
from edgeserve.bench.transports import HttpTransport

ACCURACY_SAMPLES = 4
Outputs = list[dict[str, "npt.NDArray[Any]"]]


def compare(reference: Outputs, got: Outputs) -> dict[str, float]:
    """Worst error over the output's scale, lowest cosine similarity and top-1 agreement (on the last
    axis), over samples and outputs. The scale of an output is its range over every reference sample,
    or its largest magnitude when that is larger: a softmax of two near-equal classes (range ~0) or a
    near-zero map does not blow the figure up."""
    scales: dict[str, float] = {}
    for sample in reference:
        for name, ref in sample.items():
            a = ref.astype(np.float64)
            if a.size:
                scale = max(float(a.max() - a.min()), float(np.abs(a).max()))
                scales[name] = max(scales.get(name, 0.0), scale)
    worst, cosine, agree, total = 0.0, 1.0, 0, 0
    for ref_sample, got_sample in zip(reference, got, strict=True):
        for name, ref in ref_sample.items():
            if name not in got_sample or got_sample[name].shape != ref.shape:
                return {"max_err_over_range": float("inf"), "cosine_min": 0.0, "top1_agreement": 0.0}
            a = ref.astype(np.float64)
            b = got_sample[name].astype(np.float64)
            worst = max(worst, float(np.abs(a - b).max(initial=0.0)) / max(scales.get(name, 0.0), 1e-6))
            norm = float(np.linalg.norm(a) * np.linalg.norm(b))
            dot = float(a.ravel() @ b.ravel())
            cosine = min(cosine, dot / norm if norm > 0 else (1.0 if np.array_equal(a, b) else 0.0))
            if a.ndim and a.shape[-1] > 1:
                agree += int((a.argmax(-1) == b.argmax(-1)).sum())
                total += int(a.size // a.shape[-1])
    return {
        "max_err_over_range": worst,
        "cosine_min": cosine,
        "top1_agreement": agree / total if total else 1.0,
    }


class Reference:
    """The fp32 outputs every lower-precision candidate is held to (kept in the out dir)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outputs: Outputs | None = None
        if path.is_file():
            with np.load(path, allow_pickle=False) as data:
                count = 1 + max((int(k.split("/", 1)[0]) for k in data.files), default=-1)
                self.outputs = [{} for _ in range(count)]
                for key in data.files:
                    index, name = key.split("/", 1)
                    self.outputs[int(index)][name] = data[key]

    def save(self, outputs: Outputs) -> None:
        self.outputs = outputs
        arrays = {f"{i}/{name}": array for i, sample in enumerate(outputs) for name, array in sample.items()}
        with open(self.path, "wb") as handle:
            np.savez(handle, **arrays)  # type: ignore[arg-type]


async def outputs(
    http_url: str,
    info: ModelInfo,
    shapes: Sequence[str],
    input_data: Sequence[str],
    seed: int,
    timeout_s: float,
) -> Outputs:
    """The outputs of the first few samples (batch 1), decoded: what the accuracy check compares."""
    one_shapes = resolve_shapes(info, 1, parse_shape_flags(shapes))
    samples = make_samples(info, one_shapes, list(input_data), seed)
    transport = HttpTransport(http_url, info, samples[:ACCURACY_SAMPLES], timeout_s)
    await transport.open(1)
    try:
        return [await transport.outputs(i) for i in range(len(transport.samples))]
    finally:
        await transport.close()
