"""The accuracy guard on real runtimes: bf16 within tolerance passes, a tiny tolerance rejects it; cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeserve.hardware.accuracy import AccuracyGuard, relative_error, sample_feeds
from edgeserve.hardware.plan import PlanOption
from edgeserve.hardware.probes import probe_hardware
from edgeserve.samples import build_mlp

pytest.importorskip("openvino", reason="openvino is not installed")
BF16_CPU = probe_hardware("/").cpu.bf16
BF16 = PlanOption("openvino", "CPU", "bf16")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return build_mlp(tmp_path / "mlp" / "1" / "model.onnx")


@pytest.mark.skipif(
    not BF16_CPU, reason="this CPU has no native bf16 (AVX512_BF16/AMX): openvino would run f32"
)
def test_bf16_within_tolerance_then_rejected_under_a_tiny_one(model: Path, tmp_path: Path) -> None:
    guard = AccuracyGuard(tmp_path / "cache")
    ok = guard(model, BF16, 1e-2)
    assert ok.ok and ok.error is not None and 0 < ok.error <= 1e-2, ok
    assert "measured on 3 random inputs" in ok.reason
    tight = guard(model, BF16, 1e-6)
    assert not tight.ok and "outside tolerance 1e-06 (cached)" in tight.reason  # re-judged from the cache
    assert tight.error == ok.error
    # a restart (new guard object) reuses the cached measurement
    again = AccuracyGuard(tmp_path / "cache")(model, BF16, 1e-2)
    assert again.ok and "(cached)" in again.reason
    assert list((tmp_path / "cache" / "accuracy").glob("*.json"))


@pytest.mark.skipif(BF16_CPU, reason="this CPU runs bf16 natively")
def test_bf16_without_native_support_is_refused(model: Path, tmp_path: Path) -> None:
    result = AccuracyGuard(tmp_path / "cache")(model, BF16, 1e-2)
    assert not result.ok and "although bf16 was asked" in result.reason


def test_fp32_candidate_measures_zero(model: Path) -> None:
    figures, note = AccuracyGuard(None).measure(model, PlanOption("openvino", "CPU", "fp32"))
    assert [f.name for f in figures] == ["OUTPUT0"] and note is None
    assert figures[0].range_error < 1e-6 and figures[0].cosine > 1 - 1e-9 and figures[0].top1 == 1.0


def test_unrunnable_model_is_refused_not_raised(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not onnx")
    result = AccuracyGuard(tmp_path / "cache")(bad, BF16, 1e-2)
    assert not result.ok and result.reason.startswith("could not run the check")


def test_helpers() -> None:
    ref = [np.array([1.0, -2.0, 4.0], dtype=np.float32)]
    assert relative_error(ref, [np.array([1.0, -2.0, 4.04], dtype=np.float32)]) == pytest.approx(
        0.01, rel=1e-3
    )
    assert relative_error(ref, [np.zeros(2)]) == float("inf")
    feeds = sample_feeds([("x", np.dtype(np.float32), [-1, 3, -1]), ("i", np.dtype(np.int64), [2])], 2, 0)
    assert feeds[0]["x"].shape == (1, 3, 64) and feeds[0]["i"].dtype == np.int64
    again = sample_feeds([("x", np.dtype(np.float32), [-1, 3, -1]), ("i", np.dtype(np.int64), [2])], 2, 0)
    assert np.array_equal(feeds[1]["x"], again[1]["x"])  # deterministic
