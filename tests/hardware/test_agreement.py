"""OpenVINO and ONNX Runtime really run here and agree with each other (fp32) within tolerance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from onnx_models import build_conv_dynamic_hw, build_mlp
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends.base import BackendOptions, get_backend

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
pytest.importorskip("openvino", reason="openvino is not installed")
HAVE_BACKENDS = all(importlib.util.find_spec(f"edgeserve.backends.{b}") for b in ("onnxruntime", "openvino"))


def _run_direct(path: Path, feed: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    import onnxruntime as ort
    import openvino as ov

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return session.run(None, feed), [np.asarray(v) for v in compiled(feed).values()]


def _run_backends(path: Path, feed: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    results = []
    for name in ("onnxruntime", "openvino"):
        backend = get_backend(name)
        instance = backend.load(
            path, mc.ModelConfig(), BackendOptions(device="CPU", precision="fp32", threads=1)
        )
        try:
            out = instance.infer(feed)
            results.append([out[t.name] for t in instance.io.outputs])
        finally:
            instance.close()
    return results[0], results[1]


@pytest.mark.parametrize("builder", ["mlp", "conv"])
@pytest.mark.parametrize("via", ["backends", "runtimes"])
def test_openvino_agrees_with_onnxruntime(builder: str, via: str, tmp_path: Path) -> None:
    if via == "backends" and not HAVE_BACKENDS:
        pytest.skip("edgeserve's onnxruntime/openvino backend modules are not in this tree")
    rng = np.random.default_rng(7)
    if builder == "mlp":
        path = build_mlp(tmp_path / "model.onnx")
        feed = {"INPUT0": rng.standard_normal((5, 16)).astype(np.float32)}
    else:
        path = build_conv_dynamic_hw(tmp_path / "model.onnx")
        feed = {"images": rng.random((2, 3, 24, 40), dtype=np.float32)}
    ort_out, ov_out = (_run_backends if via == "backends" else _run_direct)(path, feed)
    assert len(ort_out) == len(ov_out)
    for a, b in zip(ort_out, ov_out, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
