"""Models of other shapes than the samples, for bench_plan.py (built with the onnx helper, seeded):

- resnet_nhwc: a ResNet-18-like image classifier, NHWC FP32 input [1, 224, 224, 3] (the issue's kind
  of model: the rule served it on OpenVINO bf16 where ONNX Runtime fp32 was faster), about 27 MB;
- transformer: two encoder layers (attention with MatMul/Softmax, LayerNormalization, a ReLU FFN) on
  [N, 64 tokens, 256], batching with preferred size 4;
- wide_mlp: 1024 -> 2048 -> 2048 -> 1000 with softmax, about 29 MB, batching with preferred size 8.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeserve.samples import save_onnx


class _Graph:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array: np.ndarray, prefix: str = "w") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(array.astype(array.dtype), name))
        return name

    def weight(self, shape: tuple[int, ...], fan_in: int) -> str:
        return self.const((self.rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32))

    def op(self, kind: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(kind.lower())
        self.nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def save(
        self, path: Path, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], last: str
    ) -> Path:
        self.nodes.append(helper.make_node("Identity", [last], [outputs[0].name]))
        graph = helper.make_graph(self.nodes, path.parent.parent.name, inputs, outputs, self.inits)
        return save_onnx(graph, path, producer="edgeserve-bench")


def _conv(g: _Graph, x: str, cin: int, cout: int, k: int, stride: int, relu: bool = True) -> str:
    w = g.weight((cout, cin, k, k), cin * k * k)
    b = g.const(np.zeros(cout, np.float32), "b")
    y = g.op("Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)
    return g.op("Relu", [y]) if relu else y


def build_resnet_nhwc(path: Path) -> Path:
    g = _Graph(1)
    x = g.op("Transpose", ["image"], perm=[0, 3, 1, 2])
    x = _conv(g, x, 3, 64, 7, 2)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, blocks, stride in ((64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 1, 2)):
        for block in range(blocks):
            s = stride if block == 0 else 1
            y = _conv(g, x, cin, cout, 3, s)
            y = _conv(g, y, cout, cout, 3, 1, relu=False)
            skip = x if (s == 1 and cin == cout) else _conv(g, x, cin, cout, 1, s, relu=False)
            x = g.op("Relu", [g.op("Add", [y, skip])])
            cin = cout
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])])
    logits = g.op("Gemm", [x, g.weight((512, 1000), 512), g.const(np.zeros(1000, np.float32), "b")])
    probs = g.op("Softmax", [logits], axis=-1)
    return g.save(
        path,
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 224, 224, 3])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 1000])],
        probs,
    )


def build_transformer(path: Path, tokens: int = 64, dim: int = 256, layers: int = 2) -> Path:
    g = _Graph(2)
    x = "tokens"
    scale = g.const(np.array(1.0 / np.sqrt(dim), np.float32), "s")
    for _ in range(layers):
        q = g.op("MatMul", [x, g.weight((dim, dim), dim)])
        k = g.op("MatMul", [x, g.weight((dim, dim), dim)])
        v = g.op("MatMul", [x, g.weight((dim, dim), dim)])
        att = g.op(
            "Softmax",
            [g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])]), scale])],
            axis=-1,
        )
        out = g.op("MatMul", [g.op("MatMul", [att, v]), g.weight((dim, dim), dim)])
        ones, zeros = g.const(np.ones(dim, np.float32)), g.const(np.zeros(dim, np.float32))
        x = g.op("LayerNormalization", [g.op("Add", [x, out]), ones, zeros], axis=-1)
        hidden = g.op("Relu", [g.op("MatMul", [x, g.weight((dim, 4 * dim), dim)])])
        ffn = g.op("MatMul", [hidden, g.weight((4 * dim, dim), 4 * dim)])
        ones, zeros = g.const(np.ones(dim, np.float32)), g.const(np.zeros(dim, np.float32))
        x = g.op("LayerNormalization", [g.op("Add", [x, ffn]), ones, zeros], axis=-1)
    return g.save(
        path,
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["N", tokens, dim])],
        [helper.make_tensor_value_info("encoded", TensorProto.FLOAT, ["N", tokens, dim])],
        x,
    )


def build_wide_mlp(path: Path) -> Path:
    g = _Graph(3)
    x = "features"
    for fan_in, fan_out in ((1024, 2048), (2048, 2048)):
        x = g.op(
            "Relu",
            [
                g.op(
                    "Gemm",
                    [x, g.weight((fan_in, fan_out), fan_in), g.const(np.zeros(fan_out, np.float32), "b")],
                )
            ],
        )
    logits = g.op("Gemm", [x, g.weight((2048, 1000), 2048), g.const(np.zeros(1000, np.float32), "b")])
    probs = g.op("Softmax", [logits], axis=-1)
    return g.save(
        path,
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 1024])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 1000])],
        probs,
    )


CONFIGS = {
    # no config: auto-completed, instance count not set (the race may serve 2 instances)
    "resnet_nhwc": None,
    "transformer": "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 4 ] }\n"
    "instance_group [ { kind: KIND_CPU, count: 1 } ]\n",
    "wide_mlp": "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 8 ] }\n",
}
BUILDERS = {"resnet_nhwc": build_resnet_nhwc, "transformer": build_transformer, "wide_mlp": build_wide_mlp}


def build_all(repo: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Build each model (once; `names`: only those) into `repo`; returns name -> model folder."""
    out: dict[str, Path] = {}
    for name in BUILDERS if names is None else names:
        builder = BUILDERS[name]
        folder = repo / name
        if not (folder / "1" / "model.onnx").exists():
            builder(folder / "1" / "model.onnx")
        config = CONFIGS[name]
        if config is not None:
            (folder / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
        out[name] = folder
    return out
