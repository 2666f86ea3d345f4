"""Small real ONNX models built for tests (no runtime is mocked: these run in onnxruntime and openvino)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeserve.samples import build_mlp, save_onnx

__all__ = [
    "MLP_CONFIG",
    "ORT",
    "build_add_sub",
    "build_bf16_identity",
    "build_conv_dynamic_hw",
    "build_identity",
    "build_matmul_chain",
    "build_mlp",
    "write_model",
]

ORT = 'backend: "onnxruntime"\n'  # the rest of a config.pbtxt is auto-completed from the model
MLP_CONFIG = """backend: "onnxruntime"
max_batch_size: 8
input { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }
output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }
"""  # build_mlp's model, batching up to 8 rows

ONNX_TYPES = {
    "FP32": TensorProto.FLOAT,
    "FP16": TensorProto.FLOAT16,
    "FP64": TensorProto.DOUBLE,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "BOOL": TensorProto.BOOL,
    "BYTES": TensorProto.STRING,
}


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    return save_onnx(graph, path, opset=opset, producer="edgeserve-tests")


def build_add_sub(path: Path, datatype: str = "FP32", dims: int = 16, batch: bool = True) -> Path:
    """Triton's "simple" model: INPUT0, INPUT1 -> OUTPUT0 = a + b, OUTPUT1 = a - b."""
    shape: list[int | str] = (["N"] if batch else []) + [dims]
    t = ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        [
            helper.make_tensor_value_info("INPUT0", t, shape),
            helper.make_tensor_value_info("INPUT1", t, shape),
        ],
        [
            helper.make_tensor_value_info("OUTPUT0", t, shape),
            helper.make_tensor_value_info("OUTPUT1", t, shape),
        ],
    )
    return _save(graph, path)


def build_identity(path: Path, datatype: str = "FP32", shape: list[int | str] | None = None) -> Path:
    """INPUT0 -> OUTPUT0 unchanged, any datatype (BYTES too); default shape [N, -1]."""
    shape = shape if shape is not None else ["N", "D"]
    t = ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", t, shape)],
        [helper.make_tensor_value_info("OUTPUT0", t, shape)],
    )
    return _save(graph, path)


def build_bf16_identity(path: Path) -> Path:
    """x -> y, BF16 [N] (not in ONNX_TYPES: runtimes differ on BF16, so tests name it on purpose)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["N"])],
    )
    return _save(graph, path)


def build_conv_dynamic_hw(path: Path, channels: int = 3, out_channels: int = 4, seed: int = 1) -> Path:
    """A 3x3 conv with dynamic batch, height and width: images [N,3,H,W] -> features [N,4,H,W]."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_channels, channels, 3, 3)).astype(np.float32) * 0.2
    bias = rng.standard_normal(out_channels).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["images", "W", "B"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["features"]),
        ],
        "conv_dyn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", channels, "H", "W"])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", out_channels, "H", "W"])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")],
    )
    return _save(graph, path)


def build_matmul_chain(path: Path, layers: int, dim: int = 256, weights: int = 0, seed: int = 0) -> Path:
    """x [N, dim] -> y [N, dim] through `layers` MatMul+Tanh: milliseconds per row on one thread, so a
    flood overloads it. `weights` > 0: that many matrices shared by every layer (a slow model stays a
    small file); 0: one per layer."""
    rng = np.random.default_rng(seed)
    count = weights if weights > 0 else layers
    inits = [
        numpy_helper.from_array((rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32), f"w{i}")
        for i in range(count)
    ]
    nodes, prev = [], "x"
    for i in range(layers):
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"w{i % count}"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", dim])],
        inits,
    )
    return _save(graph, path)


def write_model(
    repo: Path, name: str, builder: str = "mlp", version: int = 1, config: str | None = None, **kwargs: object
) -> Path:
    """Create `<repo>/<name>/<version>/model.onnx` (and config.pbtxt when given); returns the model dir."""
    builders = {
        "mlp": build_mlp,
        "add_sub": build_add_sub,
        "identity": build_identity,
        "conv": build_conv_dynamic_hw,
        "chain": build_matmul_chain,
    }
    model_dir = repo / name
    builders[builder](model_dir / str(version) / "model.onnx", **kwargs)  # type: ignore[operator]
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    return model_dir
