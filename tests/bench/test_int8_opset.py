"""`tune --int8` on a model exported at an old opset (tf2onnx's ResNets come at opset 9): per-channel
weights need DequantizeLinear's axis (opset 13), which quantize_static writes after lifting such a model
only to opset 11, leaving a model ONNX Runtime refuses. The model is lifted to opset 13 first; and a
candidate that its runtime refuses is rejected by the guard with the reason instead of ending the tune
with a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from int8_cnn import CONFIG, build_cnn, clear_inputs

from edgeserve.bench import calibration
from edgeserve.bench.int8_guard import Thresholds, check
from edgeserve.bench.tune_int8 import Int8Options, calibrate


def _opset(model: onnx.ModelProto) -> int:
    return int(next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))


@pytest.fixture(scope="module")
def old_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("opset") / "cnn"
    build_cnn(model_dir / "1" / "model.onnx", opset=11)
    (model_dir / "config.pbtxt").write_text(CONFIG)
    folder = model_dir.parent / "samples"
    folder.mkdir()
    np.save(folder / "crops.npy", clear_inputs(model_dir / "1" / "model.onnx", 16, seed=4))
    return model_dir


def test_an_old_opset_model_is_lifted_and_keeps_per_channel_weights(old_model: Path, tmp_path: Path) -> None:
    assert _opset(onnx.load(str(old_model / "1" / "model.onnx"))) == 11
    said: list[str] = []
    options = Int8Options(source="folder", folder=old_model.parent / "samples", engines=("onnxruntime",),
                          work_root=tmp_path / "work")  # fmt: skip
    extras = calibrate(options, old_model, old_model / "1", tmp_path / "out", False, said.append)
    assert any("opset 11 -> 13 (per-channel weights need it)" in line for line in said), said
    assert [e.tag.split(":")[0] for e in extras] == ["int8"] and "top-1 100.0%" in (extras[0].note or "")

    quantized = next(iter(extras[0].files.values()))
    model = onnx.load(str(quantized))
    assert _opset(model) >= 13
    weights = {i.name: i for i in model.graph.initializer}
    per_channel = [
        n for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in weights
        and weights[n.input[0]].data_type == onnx.TensorProto.INT8 and len(weights[n.input[1]].dims) == 1
        and weights[n.input[1]].dims[0] > 1
    ]  # fmt: skip
    assert per_channel  # one scale per output channel, not a single one
    ort.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])  # ONNX Runtime takes it


def test_a_candidate_the_runtime_refuses_is_rejected_with_the_reason(old_model: Path, tmp_path: Path) -> None:
    said: list[str] = []
    options = Int8Options(source="folder", folder=old_model.parent / "samples", engines=("onnxruntime",),
                          work_root=tmp_path / "work")  # fmt: skip
    good = next(iter(calibrate(options, old_model, old_model / "1", tmp_path / "out", False, said.append)[0]
                      .files.values()))  # fmt: skip
    # what quantize_static alone writes for such a model: per-channel DequantizeLinear at opset 11
    broken = onnx.load(str(good))
    for entry in broken.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = 11
    path = tmp_path / "broken.onnx"
    onnx.save(broken, str(path))
    with pytest.raises(Exception, match="axis"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    fp32 = old_model / "1" / "model.onnx"
    rows = calibration._rows({"x": np.load(old_model.parent / "samples" / "crops.npy")[:4]},
                             calibration.onnx_inputs(fp32), "test")  # fmt: skip
    verdict = check(fp32, path, rows, Thresholds())
    assert not verdict.ok and verdict.reason.startswith("ONNX Runtime does not run it (")
    assert "axis" in verdict.reason and "\n" not in verdict.reason
