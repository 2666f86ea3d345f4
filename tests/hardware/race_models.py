"""Small real ONNX models for the race and accuracy-guard tests (they run in onnxruntime and openvino)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnx_models import _save

# The config of build_wide_mlp's model, as a Triton user writes it (the race tests add their batching).
WIDE_CONFIG = """
name: "wide"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "scores", data_type: TYPE_FP32, dims: [ 10 ] } ]
"""


def build_cancellation(path: Path, width: int = 64, offset: float = 1000.0) -> Path:
    """z = (x + offset) @ W - offset * colsum(W): exactly x @ W in fp32, but a bf16/fp16 MatMul sees
    x + 1000 rounded to steps of 4 (bf16) and returns noise. A genuinely broken low precision."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((width, width)) * 0.1).astype(np.float32)
    shift = (np.float32(offset) * weight.sum(0)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "offset"], ["h"]),
            helper.make_node("MatMul", ["h", "W"], ["y"]),
            helper.make_node("Sub", ["y", "shift"], ["z"]),
        ],
        "cancellation",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", width])],
        [
            numpy_helper.from_array(np.array([offset], np.float32), "offset"),
            numpy_helper.from_array(weight, "W"),
            numpy_helper.from_array(shift, "shift"),
        ],
    )
    return _save(graph, path)


def build_wide_mlp(path: Path, features: int = 256, hidden: int = 512, classes: int = 10) -> Path:
    """[N, features] -> Gemm/Relu/Gemm/Softmax -> [N, classes] (about 0.5 MiB: above OpenVINO's floor)."""
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "W2"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
        ],
        "wide_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")],
    )
    return _save(graph, path)
