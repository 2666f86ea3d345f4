"""The ONNX Runtime backend on real models: numpy references, BYTES, session options, CPU fallback."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx_models import build_add_sub, build_bf16_identity, build_conv_dynamic_hw, build_identity, build_mlp

from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends.base import BackendOptions, ModelIO, TensorSpec
from edgeserve.protocol.errors import InferenceError, Status

BACKEND = ortb.BACKEND


def _weights(path: Path) -> dict[str, Any]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def mlp_reference(path: Path, x: np.ndarray) -> np.ndarray:
    w = _weights(path)
    h = np.maximum(x.astype(np.float64) @ w["w1"] + w["b1"], 0.0)
    logits = h @ w["w2"] + w["b2"]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True))


def conv_reference(path: Path, x: np.ndarray) -> np.ndarray:
    w = _weights(path)
    weight, bias = w["W"].astype(np.float64), w["B"].astype(np.float64)
    n, _, h, wd = x.shape
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, weight.shape[0], h, wd))
    for dy in range(3):
        for dx in range(3):
            out += np.einsum("nchw,oc->nohw", padded[:, :, dy : dy + h, dx : dx + wd], weight[:, :, dy, dx])
    return np.maximum(out + bias[None, :, None, None], 0.0)


def test_backend_declares_its_contract() -> None:
    assert BACKEND.name == "onnxruntime"
    assert BACKEND.platforms == ("onnxruntime_onnx",)
    assert BACKEND.artifacts == ("model.onnx",)
    assert BACKEND.unavailable_reason() is None


def test_inspect_maps_types_and_symbolic_dims(tmp_path: Path) -> None:
    io = BACKEND.inspect(build_mlp(tmp_path / "mlp.onnx"))
    assert io == ModelIO((TensorSpec("INPUT0", "FP32", (-1, 16)),), (TensorSpec("OUTPUT0", "FP32", (-1, 4)),))
    conv = BACKEND.inspect(build_conv_dynamic_hw(tmp_path / "conv.onnx"))
    assert conv.inputs[0].shape == (-1, 3, -1, -1) and conv.outputs[0].shape == (-1, 4, -1, -1)
    for datatype in ("FP16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                     "UINT64", "BOOL", "BYTES"):  # fmt: skip
        io = BACKEND.inspect(build_identity(tmp_path / f"id_{datatype}.onnx", datatype, shape=[2, "D"]))
        assert io.inputs[0] == TensorSpec("INPUT0", datatype, (2, -1))


def test_mlp_matches_numpy(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    instance = BACKEND.load(path, None, BackendOptions(threads=1))
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    out = instance.infer({"INPUT0": x})
    assert set(out) == {"OUTPUT0"} and out["OUTPUT0"].dtype == np.float32
    np.testing.assert_allclose(out["OUTPUT0"], mlp_reference(path, x), rtol=1e-5, atol=1e-6)


def test_conv_with_dynamic_height_and_width(tmp_path: Path) -> None:
    path = build_conv_dynamic_hw(tmp_path / "conv.onnx")
    instance = BACKEND.load(path, None, BackendOptions())
    rng = np.random.default_rng(4)
    for shape in ((1, 3, 8, 8), (2, 3, 17, 5)):
        x = rng.standard_normal(shape).astype(np.float32)
        out = instance.infer({"images": x})["features"]
        assert out.shape == (shape[0], 4, shape[2], shape[3])
        np.testing.assert_allclose(out, conv_reference(path, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "FP64", "INT32", "INT64", "INT8", "UINT8"])
def test_add_sub_in_many_datatypes(tmp_path: Path, datatype: str) -> None:
    path = build_add_sub(tmp_path / "add_sub.onnx", datatype)
    instance = BACKEND.load(path, None, BackendOptions())
    dtype = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT32": np.int32,
             "INT64": np.int64, "INT8": np.int8, "UINT8": np.uint8}[datatype]  # fmt: skip
    a = np.arange(32, dtype=dtype).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=dtype)
    out = instance.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    only = instance.infer({"INPUT0": a, "INPUT1": b}, ["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]


def test_non_contiguous_input_is_accepted(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    instance = BACKEND.load(path, None, BackendOptions())
    x = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32).T  # a transposed view
    np.testing.assert_allclose(instance.infer({"INPUT0": x})["OUTPUT0"], mlp_reference(path, x), atol=1e-6)


def test_bytes_round_trip_as_bytes(tmp_path: Path) -> None:
    instance = BACKEND.load(build_identity(tmp_path / "id.onnx", "BYTES"), None, BackendOptions())
    x = np.array([[b"abc", "héllo".encode(), b""]], dtype=np.object_)
    out = instance.infer({"INPUT0": x})["OUTPUT0"]
    assert out.dtype == np.object_ and out.shape == (1, 3)
    assert out.tolist() == [[b"abc", "héllo".encode(), b""]]
    with pytest.raises(InferenceError) as err:
        instance.infer({"INPUT0": np.array([[b"\xff\xfe"]], dtype=np.object_)})
    assert err.value.status is Status.INVALID_ARG and "UTF-8" in err.value.message


def test_session_options_for_small_devices() -> None:
    so = ortb.session_options(BackendOptions(threads=3))
    assert so.intra_op_num_threads == 3 and so.inter_op_num_threads == 1
    assert so.enable_cpu_mem_arena is True and so.enable_mem_pattern is True  # unset: standard's arena
    dynamic = ortb.session_options(BackendOptions(threads=3), dynamic_shapes=True)
    assert dynamic.enable_cpu_mem_arena is False  # would keep the peak of every shape seen
    forced = ortb.session_options(BackendOptions(threads=3, parameters={"ort_memory_arena": "true"}), True)
    assert forced.enable_cpu_mem_arena is True  # the setting or the model's parameter wins
    from edgeserve.backends import memory

    previous = memory.current()
    memory.use(memory.SMALL)
    try:  # the small profile keeps the arena off; a model's parameter wins over either
        assert ortb.session_options(BackendOptions(threads=3)).enable_cpu_mem_arena is False
    finally:
        memory.use(previous)
    off = ortb.session_options(BackendOptions(threads=1, parameters={"ort_memory_arena": "false"}))
    assert off.enable_cpu_mem_arena is False
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    import onnxruntime as ort

    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    tuned = ortb.session_options(
        BackendOptions(
            threads=0,
            parameters={
                "ort_memory_arena": "true",
                "ort_allow_spinning": "true",
                "session.use_device_allocator_for_initializers": "1",
            },
        )
    )
    assert tuned.intra_op_num_threads == 0 and tuned.enable_cpu_mem_arena is True
    assert tuned.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert tuned.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"


def test_provider_plan_keeps_cpu_last() -> None:
    chosen, missing = ortb.plan_providers(
        ["TensorRT", "CUDAExecutionProvider", "cpu"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    assert chosen == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert missing == ["TensorrtExecutionProvider"]
    assert ortb.plan_providers([], ["CPUExecutionProvider"]) == (["CPUExecutionProvider"], [])


def test_missing_provider_falls_back_to_cpu_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    with caplog.at_level(logging.WARNING, logger="edgeserve.backends.onnxruntime"):
        instance = BACKEND.load(path, None, BackendOptions(providers=("TensorrtExecutionProvider", "CUDA")))
    assert instance.providers == ("CPUExecutionProvider",)
    assert instance.fallback_reason is not None
    assert (
        "TensorrtExecutionProvider" in instance.fallback_reason
        and "CUDAExecutionProvider" in instance.fallback_reason
    )
    assert any("CPU fallback" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    plain = BACKEND.load(path, None, BackendOptions())
    assert plain.fallback_reason is None


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "1" / "model.onnx"
    garbage.parent.mkdir()
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(InferenceError) as err:
        BACKEND.load(garbage, None, BackendOptions())
    assert err.value.status in (Status.INVALID_ARG, Status.INTERNAL)
    assert str(garbage) in err.value.message
    with pytest.raises(InferenceError) as missing:
        BACKEND.inspect(tmp_path / "nope.onnx")
    assert str(tmp_path / "nope.onnx") in missing.value.message


def test_model_onnx_may_be_a_directory(tmp_path: Path) -> None:
    build_mlp(tmp_path / "1" / "model.onnx" / "model.onnx")
    assert BACKEND.inspect(tmp_path / "1" / "model.onnx").inputs[0].name == "INPUT0"


def test_bad_input_and_closed_session(tmp_path: Path) -> None:
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions())
    with pytest.raises(InferenceError) as err:
        instance.infer({"INPUT0": np.zeros((2, 15), np.float32)})
    assert err.value.status is Status.INVALID_ARG
    instance.close()
    instance.close()  # idempotent
    with pytest.raises(InferenceError) as closed:
        instance.infer({"INPUT0": np.zeros((2, 16), np.float32)})
    assert closed.value.status is Status.UNAVAILABLE


def test_unsupported_tensor_type_is_a_clear_error(tmp_path: Path) -> None:
    build_bf16_identity(tmp_path / "bf16.onnx")
    with pytest.raises(InferenceError) as err:
        BACKEND.inspect(tmp_path / "bf16.onnx")
    assert "tensor(bfloat16)" in err.value.message and "'x'" in err.value.message
