"""OpenVINO's idle release (edgeserve/backends/openvino_memory.py) on a real compiled model with dynamic
shapes: the buffers go (release_memory, a fresh infer request) once the model was idle for the memory
profile's time, never while a call holds it, after every call with 0, and the next call still answers
right; the per-model weights estimate (in /metrics) is the compiled constants."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from onnx_models import build_conv_dynamic_hw

from edgeserve.backends import memory
from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends import openvino as ovb
from edgeserve.backends.base import BackendOptions

FP32 = BackendOptions(precision="fp32", threads=1)


@pytest.fixture
def profile() -> Iterator[None]:
    before = memory.current()
    yield
    memory.use(before)


def _expected(path: Path, x: np.ndarray) -> np.ndarray:
    return ortb.BACKEND.load(path, None, BackendOptions()).infer({"images": x})["features"]


def test_released_only_once_idle(tmp_path: Path, profile: None) -> None:
    memory.use(memory.resolve("standard", None))  # 10 s idle
    path = build_conv_dynamic_hw(tmp_path / "conv.onnx")
    instance = ovb.BACKEND.load(path, None, FP32)
    idle = instance._memory
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 40)).astype(np.float32)
    instance.infer({"images": x})
    assert idle.dirty and idle.releases == 0
    assert not idle.release_if_idle(time.monotonic())  # used just now
    with idle.busy:  # a call in flight (the process's release thread cannot get in either)
        idle.used_at -= idle.idle_s + 1  # as if it had been idle that long
        assert not idle.release_if_idle(time.monotonic()) and idle.releases == 0
    # released once, here or by the release thread, which may get in first
    assert idle.release_if_idle(time.monotonic()) and idle.releases == 1 and not idle.dirty
    np.testing.assert_allclose(
        instance.infer({"images": x})["features"], _expected(path, x), rtol=1e-5, atol=1e-5
    )
    weights = 4 * 3 * 3 * 3 * 4 + 4 * 4  # the f32 conv weight and bias (and a few bytes of shape constants)
    assert weights <= instance.memory_estimate()["weights"] < weights + 64
    instance.close()


def test_zero_releases_after_every_call(tmp_path: Path, profile: None) -> None:
    memory.use(dataclasses.replace(memory.resolve("small", None), ov_release_idle_s=0.0))
    path = build_conv_dynamic_hw(tmp_path / "conv.onnx")
    instance = ovb.BACKEND.load(path, None, FP32)
    rng = np.random.default_rng(4)
    for shape in ((1, 3, 16, 16), (2, 3, 24, 8)):
        x = rng.standard_normal(shape).astype(np.float32)
        out = instance.infer({"images": x})["features"]
        np.testing.assert_allclose(out, _expected(path, x), rtol=1e-5, atol=1e-5)
    assert instance._memory.releases == 2 and not instance._memory.dirty
    instance.close()
