"""A small real CNN for the INT8 tests (conv + relu + maxpool, twice, global average pool, gemm), built
with onnx.helper, and inputs it answers with a clear top-1 (so INT8 rounding does not flip near ties)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 32  # input 3 x SIZE x SIZE
CLASSES = 10

CONFIG = """
name: "cnn"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 3, 32, 32 ] } ]
output [ { name: "logits", data_type: TYPE_FP32, dims: [ 10 ] } ]
"""

WARMUP = """
model_warmup [
  {
    name: "frames"
    batch_size: 8
    inputs { key: "x", value: { data_type: TYPE_FP32, dims: [ 3, 32, 32 ], input_data_file: "frames.bin" } }
  },
  {
    name: "more_frames"
    batch_size: 8
    inputs { key: "x", value: { data_type: TYPE_FP32, dims: [ 3, 32, 32 ], input_data_file: "more.bin" } }
  }
]
"""


def build_cnn(path: Path, seed: int = 7, opset: int = 17) -> Path:
    rng = np.random.default_rng(seed)

    def he(*shape: int) -> np.ndarray:
        fan_in = int(np.prod(shape[1:]))
        weights: np.ndarray = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        return weights

    inits = [
        numpy_helper.from_array(he(16, 3, 3, 3), "w1"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array(he(32, 16, 3, 3), "w2"),
        numpy_helper.from_array((rng.standard_normal(32) * 0.1).astype(np.float32), "b2"),
        numpy_helper.from_array(he(CLASSES, 32), "w3"),
        numpy_helper.from_array(np.zeros(CLASSES, np.float32), "b3"),
        numpy_helper.from_array(np.array([-1, 32], np.int64), "flat"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p2"], ["g"]),
        helper.make_node("Reshape", ["g", "flat"], ["f"]),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def clear_inputs(model: Path, count: int, seed: int = 0, margin: float = 0.15) -> np.ndarray:
    """`count` inputs [count, 3, SIZE, SIZE] (smooth blobs in 8-bit steps, as camera frames are; exact as
    PNG files) whose fp32 top-1 leads
    the runner-up by `margin` of the logits' range: INT8 must agree on these, a near tie might not."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    kept: list[np.ndarray] = []
    ys, xs = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    for _ in range(count * 40):
        image = np.zeros((3, SIZE, SIZE), np.float32)
        for _blob in range(3):
            cy, cx, r = rng.random(3)
            colour = rng.random(3).astype(np.float32)[:, None, None]
            image += colour * np.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (0.02 + 0.1 * r))
        image += rng.normal(0, 0.05, image.shape).astype(np.float32)
        image = (np.round(np.clip(image, 0.0, 1.0) * 255) / 255).astype(np.float32)  # as an 8-bit file holds
        logits = session.run(None, {"x": image[None]})[0][0]
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] >= margin * (logits.max() - logits.min()):
            kept.append(image)
            if len(kept) == count:
                return np.stack(kept)
    raise AssertionError(f"only {len(kept)} clear inputs found")


def write_repository(repo: Path, warmup: bool = True, frames: int = 16) -> Path:
    """`<repo>/cnn/` with 1/model.onnx, config.pbtxt (with model_warmup from two input files)."""
    model_dir = repo / "cnn"
    model = build_cnn(model_dir / "1" / "model.onnx")
    (model_dir / "config.pbtxt").write_text(CONFIG + (WARMUP if warmup else ""))
    if warmup:
        data = clear_inputs(model, frames)
        (model_dir / "warmup").mkdir()
        (model_dir / "warmup" / "frames.bin").write_bytes(data[:8].tobytes())
        (model_dir / "warmup" / "more.bin").write_bytes(data[8:16].tobytes())
    return model_dir
