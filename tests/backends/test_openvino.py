"""The OpenVINO backend on real models: fp32 matches ONNX Runtime to 1e-5, IR and ONNX, properties."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from onnx_models import build_add_sub, build_bf16_identity, build_conv_dynamic_hw, build_identity, build_mlp

from edgeserve.backends import memory
from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends import openvino as ovb
from edgeserve.backends.base import PINNED_PARAMETER, BackendOptions, ModelIO, TensorSpec
from edgeserve.protocol.datatypes import BF16_DTYPE
from edgeserve.protocol.errors import InferenceError, Status

BACKEND = ovb.BACKEND
FP32 = BackendOptions(precision="fp32", threads=2)


def _ort(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return ortb.BACKEND.load(path, None, BackendOptions()).infer(inputs)


def test_backend_declares_its_contract() -> None:
    assert BACKEND.name == "openvino"
    assert BACKEND.platforms == ("openvino",)
    assert BACKEND.artifacts == ("model.xml", "model.onnx")
    assert BACKEND.unavailable_reason() is None


def test_inspect_onnx(tmp_path: Path) -> None:
    io = BACKEND.inspect(build_mlp(tmp_path / "mlp.onnx"))
    assert io == ModelIO((TensorSpec("INPUT0", "FP32", (-1, 16)),), (TensorSpec("OUTPUT0", "FP32", (-1, 4)),))
    conv = BACKEND.inspect(build_conv_dynamic_hw(tmp_path / "conv.onnx"))
    assert conv.inputs[0] == TensorSpec("images", "FP32", (-1, 3, -1, -1))


def test_mlp_fp32_matches_onnxruntime(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    instance = BACKEND.load(path, None, FP32)
    assert str(instance.compiled_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
    x = np.random.default_rng(1).standard_normal((7, 16)).astype(np.float32)
    out = instance.infer({"INPUT0": x})
    assert set(out) == {"OUTPUT0"} and out["OUTPUT0"].dtype == np.float32
    np.testing.assert_allclose(out["OUTPUT0"], _ort(path, {"INPUT0": x})["OUTPUT0"], rtol=1e-5, atol=1e-5)


def test_conv_dynamic_hw_fp32_matches_onnxruntime(tmp_path: Path) -> None:
    path = build_conv_dynamic_hw(tmp_path / "conv.onnx")
    instance = BACKEND.load(path, None, FP32)
    rng = np.random.default_rng(2)
    for shape in ((1, 3, 16, 16), (3, 3, 9, 21), (1, 3, 16, 16)):  # shapes change between calls
        x = rng.standard_normal(shape).astype(np.float32)
        out = instance.infer({"images": x})["features"]
        assert out.shape == (shape[0], 4, shape[2], shape[3])
        np.testing.assert_allclose(out, _ort(path, {"images": x})["features"], rtol=1e-5, atol=1e-5)


def test_outputs_are_not_overwritten_by_the_next_request(tmp_path: Path) -> None:
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, FP32)
    first = instance.infer({"INPUT0": np.zeros((2, 16), np.float32)})["OUTPUT0"]
    kept = first.copy()
    instance.infer({"INPUT0": np.ones((2, 16), np.float32)})
    np.testing.assert_array_equal(first, kept)


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "INT32", "INT64", "UINT8"])
def test_add_sub_in_many_datatypes(tmp_path: Path, datatype: str) -> None:
    path = build_add_sub(tmp_path / "add_sub.onnx", datatype)
    dtype = {"FP32": np.float32, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64,
             "UINT8": np.uint8}[datatype]  # fmt: skip
    # No wrap-around: OpenVINO saturates integer overflow where ONNX Runtime wraps.
    a = (np.arange(48) + 2).astype(dtype).reshape(3, 16)
    b = np.full((3, 16), 2, dtype=dtype)
    # INT64 runs only when the config names openvino itself (see the test below).
    options = replace(FP32, parameters={PINNED_PARAMETER: "openvino"}) if datatype == "INT64" else FP32
    out = BACKEND.load(path, None, options).infer({"INPUT0": a, "INPUT1": b})
    assert out["OUTPUT0"].dtype == dtype
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_int64_models_are_refused_unless_the_config_names_openvino(tmp_path: Path) -> None:
    path = build_add_sub(tmp_path / "add_sub.onnx", "INT64")
    with pytest.raises(InferenceError) as info:
        BACKEND.load(path, None, FP32)
    assert info.value.status is Status.UNSUPPORTED
    assert "computed in 32 bits" in info.value.message and 'backend: "openvino"' in info.value.message
    pinned = BACKEND.load(path, None, replace(FP32, parameters={PINNED_PARAMETER: "openvino"}))
    big = np.full((1, 16), 2**40, dtype=np.int64)
    # Why it is refused: the CPU plugin really does lose the upper bits.
    assert not np.array_equal(pinned.infer({"INPUT0": big, "INPUT1": big})["OUTPUT0"], big + big)


def test_requested_outputs_subset(tmp_path: Path) -> None:
    instance = BACKEND.load(build_add_sub(tmp_path / "m.onnx"), None, FP32)
    a = np.ones((1, 16), np.float32)
    assert list(instance.infer({"INPUT0": a, "INPUT1": a}, ["OUTPUT1"])) == ["OUTPUT1"]


def test_ir_model_xml(tmp_path: Path) -> None:
    import openvino as ov

    onnx_path = build_mlp(tmp_path / "mlp.onnx")
    xml = tmp_path / "1" / "model.xml"
    xml.parent.mkdir()
    ov.save_model(ov.Core().read_model(str(onnx_path)), str(xml), compress_to_fp16=False)
    assert (xml.parent / "model.bin").exists()
    assert BACKEND.inspect(xml).inputs[0] == TensorSpec("INPUT0", "FP32", (-1, 16))
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    out = BACKEND.load(xml, None, FP32).infer({"INPUT0": x})
    np.testing.assert_allclose(
        out["OUTPUT0"], _ort(onnx_path, {"INPUT0": x})["OUTPUT0"], rtol=1e-5, atol=1e-5
    )


def test_compile_properties() -> None:
    props = ovb.compile_properties(
        BackendOptions(precision="fp32", threads=4, performance_hint="THROUGHPUT"), None
    )
    cache = memory.current().ov_runtime_cache  # the memory profile's per-shape cache bound (CPU only)
    assert props == {
        "PERFORMANCE_HINT": "THROUGHPUT",
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": 4,
        "CPU_RUNTIME_CACHE_CAPACITY": cache,
    }
    assert (
        ovb.compile_properties(BackendOptions(precision="bf16"), None)["INFERENCE_PRECISION_HINT"] == "bf16"
    )
    assert ovb.compile_properties(BackendOptions(precision="fp16"), None)["INFERENCE_PRECISION_HINT"] == "f16"
    auto = ovb.compile_properties(BackendOptions(precision="auto", threads=0), None)
    assert "INFERENCE_PRECISION_HINT" not in auto and "INFERENCE_NUM_THREADS" not in auto
    cached = ovb.compile_properties(
        BackendOptions(cache_dir=Path("/c"), parameters={"NUM_STREAMS": "1"}), {"X"}
    )
    # unsupported properties are dropped, the runtime cache bound is kept; never CACHE_DIR: openvino would
    # load whatever blob lies there (edgeserve caches compiled models itself, sealed: openvino_cache.py)
    assert cached == {"CPU_RUNTIME_CACHE_CAPACITY": cache}
    assert "CPU_RUNTIME_CACHE_CAPACITY" not in ovb.compile_properties(BackendOptions(), None, "GPU.0")
    assert (
        ovb.compile_properties(BackendOptions(parameters={"NUM_STREAMS": "1", "ort_x": "y"}), None)[
            "NUM_STREAMS"
        ]
        == "1"
    )
    assert ovb.ov_device("gpu:1") == "GPU.1" and ovb.ov_device("CPU") == "CPU"


def test_threads_and_cache_dir_reach_the_runtime(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None,
                            BackendOptions(precision="fp32", threads=1, cache_dir=cache))  # fmt: skip
    assert int(instance.compiled_property("INFERENCE_NUM_THREADS")) == 1
    blobs = list(cache.glob("*.ovblob"))
    assert len(blobs) == 1 and blobs[0].with_name(blobs[0].name + ".seal").is_file()


def test_missing_device_falls_back_to_cpu_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import openvino as ov

    if "NPU" in ov.Core().available_devices:
        pytest.skip("this box has an NPU")
    with caplog.at_level(logging.WARNING, logger="edgeserve.backends.openvino"):
        instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions(device="NPU"))
    assert instance.device == "CPU" and instance.fallback_reason and "NPU" in instance.fallback_reason
    assert any("CPU fallback" in r.getMessage() for r in caplog.records)
    assert (
        BACKEND.load(build_mlp(tmp_path / "m2.onnx"), None, BackendOptions(device="AUTO")).fallback_reason
        is None
    )


def test_string_tensors_are_refused_with_a_pointer_to_onnxruntime(tmp_path: Path) -> None:
    path = build_identity(tmp_path / "id.onnx", "BYTES")
    assert BACKEND.inspect(path).inputs[0].datatype == "BYTES"
    with pytest.raises(InferenceError) as err:
        BACKEND.load(path, None, FP32)
    assert err.value.status is Status.INVALID_ARG and "onnxruntime" in err.value.message


@pytest.mark.skipif(BF16_DTYPE is None, reason="ml_dtypes is not installed")
def test_bf16_round_trip(tmp_path: Path) -> None:
    build_bf16_identity(tmp_path / "bf16.onnx")
    instance = BACKEND.load(tmp_path / "bf16.onnx", None, FP32)
    x = np.array([1.5, -2.25, 3e20], dtype=BF16_DTYPE)
    y = instance.infer({"x": x})["y"]
    assert y.dtype == BF16_DTYPE
    np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "model.onnx"
    garbage.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(InferenceError) as err:
        BACKEND.load(garbage, None, FP32)
    assert err.value.status is Status.INVALID_ARG and str(garbage) in err.value.message
    with pytest.raises(InferenceError) as missing:
        BACKEND.inspect(tmp_path / "missing.xml")
    assert str(tmp_path / "missing.xml") in missing.value.message


def test_bad_input_and_close(tmp_path: Path) -> None:
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, FP32)
    with pytest.raises(InferenceError):
        instance.infer({"INPUT0": np.zeros((2, 15), np.float32)})
    instance.close()
    with pytest.raises(InferenceError) as closed:
        instance.infer({"INPUT0": np.zeros((2, 16), np.float32)})
    assert closed.value.status is Status.UNAVAILABLE


# Two threads converting OpenVINO types to numpy for the first time in a fresh process deadlock
# (pyopenvino's dtype table is a C++ static whose build can drop the GIL): 5 of 40 fresh processes
# hung here before `core()` built the table under its lock. The race needs fresh processes.
_FIRST_USE_RACE = """
import sys, threading
import openvino as ov
from edgeserve.backends.openvino import core
barrier = threading.Barrier(2)
def first_use():
    core()
    barrier.wait()
    ov.Type.f32.to_dtype()
threads = [threading.Thread(target=first_use) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_first_use_from_two_threads_does_not_deadlock() -> None:
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_USE_RACE]) for _ in range(12)]
    hung = 0
    for proc in procs:
        try:
            assert proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            hung += 1
    assert hung == 0, f"{hung} of {len(procs)} processes deadlocked on OpenVINO's first use"
