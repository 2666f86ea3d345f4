"""The accuracy guard on real runtimes: bf16 within tolerance passes, a tiny tolerance rejects it; cached;
a genuinely broken precision is rejected; the figures; representative inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from race_models import build_cancellation, build_wide_mlp

from edgeserve.hardware import fidelity
from edgeserve.hardware.accuracy import AccuracyGuard, relative_error, sample_feeds
from edgeserve.hardware.inputs import model_inputs
from edgeserve.hardware.plan import PlanOption
from edgeserve.hardware.probes import probe_hardware
from edgeserve.repository.config import parse_text
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


# -- the scale-aware figures (fidelity.py) and representative inputs (inputs.py) -------------------
@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no native bf16: openvino would run f32")
def test_a_genuinely_broken_low_precision_is_rejected_and_a_fine_one_passes(tmp_path: Path) -> None:
    guard = AccuracyGuard(tmp_path / "cache")
    broken = guard(build_cancellation(tmp_path / "broken" / "model.onnx"), BF16, 1e-2)
    assert not broken.ok and "outside tolerance" in broken.reason, broken
    assert broken.figures and broken.figures[0].name == "z" and broken.figures[0].cosine < 0.9
    fine = guard(build_wide_mlp(tmp_path / "fine" / "model.onnx"), BF16, 1e-2)
    assert fine.ok and fine.figures[0].top1 == 1.0 and fine.figures[0].cosine > 0.99, fine


def test_fp16_overflow_fails_whatever_the_tolerance() -> None:
    ref = [np.array([[1.0, 7.0e4, -3.0]], dtype=np.float32)]
    with np.errstate(over="ignore"):
        overflowed = [ref[0].astype(np.float16).astype(np.float32)]  # 7e4 > 65504: inf
    figures = fidelity.compare("y", ref, overflowed)
    assert figures.nonfinite == 1
    ok, why = fidelity.judge([figures], 1.0)
    assert not ok and "non-finite" in why


def test_a_near_zero_map_is_judged_on_its_scale_not_its_last_digits() -> None:
    """A detection map that is ~0 on random inputs (as PP-OCR det is): the old max|err|/max|ref|
    called 1e-5 of noise a 20% error; relative to a probability's range it is nothing."""
    rng = np.random.default_rng(0)
    ref = [(rng.random((1, 1, 64, 64)) * 5e-5).astype(np.float32)]
    out = [ref[0] + (rng.standard_normal(ref[0].shape) * 1e-5).astype(np.float32)]
    assert relative_error(ref, out) > 0.1  # the old metric's verdict
    figures = fidelity.compare("map", ref, out)
    assert not figures.signal and figures.range_error < 1e-4
    assert fidelity.judge([figures], 1e-2)[0]
    # the same map with a real detection that the candidate misses is rejected
    ref[0][0, 0, 10:20, 10:20] = 0.9
    missed = [out[0].copy()]
    assert not fidelity.judge([fidelity.compare("map", ref, missed)], 1e-2)[0]


def test_top1_agreement_for_classifiers() -> None:
    ref = np.array([[0.1, 0.9], [0.8, 0.2], [0.51, 0.49], [0.3, 0.7]], dtype=np.float32)
    near_tie_flip = ref.copy()
    near_tie_flip[2] = [0.49, 0.51]  # within 5% of the range: a tie, not a disagreement
    figures = fidelity.compare("p", [ref], [near_tie_flip])
    assert figures.top1 == 1.0
    wrong = ref.copy()
    wrong[0] = [0.9, 0.1]
    figures = fidelity.compare("p", [ref], [wrong])
    assert figures.top1 == pytest.approx(0.75)
    ok, why = fidelity.judge([figures], 1e-2)
    assert not ok and "p:" in why


def test_model_warmup_files_and_bundle_checks_are_the_guard_inputs(tmp_path: Path) -> None:
    model_dir = tmp_path / "bundle" / "models" / "mlp"
    build_mlp(model_dir / "1" / "model.onnx")
    data = np.linspace(-1, 1, 16, dtype=np.float32)
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "row.bin").write_bytes(data.tobytes())
    config = parse_text(
        'max_batch_size: 4\ninput [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]\n'
        'model_warmup [ { name: "real" batch_size: 1 inputs { key: "INPUT0" value: '
        '{ data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "row.bin" } } } ]',
        "t",
    )
    found = model_inputs("mlp", model_dir, config)
    assert found is not None and found.real and "warm-up files" in found.source
    assert np.array_equal(found.feeds[0]["INPUT0"], data[None])
    zeros = parse_text(
        'max_batch_size: 4\ninput [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] } ]\n'
        'model_warmup [ { name: "z" batch_size: 2 inputs { key: "INPUT0" value: '
        "{ data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } } } ]",
        "t",
    )
    shaped = model_inputs("mlp", model_dir, zeros)
    assert shaped is not None and not shaped.real and len(shaped.feeds) == 3
    assert shaped.feeds[0]["INPUT0"].shape == (2, 16) and shaped.feeds[0]["INPUT0"].any()  # not zeros
    check = {"model": "mlp", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                         "data": data.tolist()}], "expected": {}}  # fmt: skip
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps({"checks": [check]}))
    bundled = model_inputs("mlp", model_dir, config)
    assert bundled is not None and bundled.real and "OTA bundle" in bundled.source
    assert bundled.digest() != shaped.digest()
    guard = AccuracyGuard(tmp_path / "cache")
    result = guard.__call__(
        model_dir / "1" / "model.onnx", PlanOption("openvino", "CPU", "fp32"), 1e-2, bundled
    )
    assert result.inputs == bundled.source and "measured on 1 OTA bundle check(s)" in result.reason
