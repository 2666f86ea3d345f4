"""The ONNX Runtime backend's load-time thread probe: a small model runs on one intra-op thread unless
the pool is measurably faster, and the served config shows the choice.

The decision is tested with scripted timings (speed is never asserted from a clock in tests); one test
lets the real probe run on a real model and checks only that it measured and chose something."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx_models import build_conv_dynamic_hw, build_mlp
from tritonclient.grpc import model_config_pb2

from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends.base import BackendOptions
from edgeserve.repository.served import _record_tuning

BACKEND = ortb.BACKEND


@pytest.fixture
def scripted_timings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[int]]]:
    """Replace the clocked probe: each call returns the next scripted list (first the size check of
    the planned session, then the planned and the one-thread session side by side)."""
    script: list[list[int]] = []

    def fake(sessions: Any, feed: Any, runs: int) -> list[int]:
        for session in sessions:
            session.run(None, feed)  # the probe input must really run
        timings = script.pop(0)
        assert len(timings) == len(sessions)
        return timings

    monkeypatch.setattr(ortb, "time_runs", fake)
    yield script
    assert not script, "the probe timed fewer times than scripted"


def _intra_op(instance: ortb.OnnxRuntimeInstance) -> int:
    return int(instance._session.get_session_options().intra_op_num_threads)


def _check_answers(instance: ortb.OnnxRuntimeInstance, path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    reference = BACKEND.load(path, None, BackendOptions(threads=1)).infer({"INPUT0": x})["OUTPUT0"]
    np.testing.assert_allclose(instance.infer({"INPUT0": x})["OUTPUT0"], reference, rtol=1e-6)


def test_small_model_runs_on_one_thread_when_that_is_faster(
    tmp_path: Path, scripted_timings: list[list[int]]
) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    scripted_timings[:] = [[40_000], [40_000, 20_000]]
    instance = BACKEND.load(path, None, BackendOptions(threads=2))
    assert instance.threads == 1 and _intra_op(instance) == 1
    assert instance.threads_note == (
        "1 intra-op thread for this small model (20 us per call with 1 thread, 40 us with 2 threads)"
    )
    assert instance.tuned_parameters == {"intra_op_thread_count": "1"}
    _check_answers(instance, path)


def test_one_thread_unless_the_pool_wins_clearly(tmp_path: Path, scripted_timings: list[list[int]]) -> None:
    scripted_timings[:] = [[40_000], [38_000, 40_000]]  # the pool 5% faster: under the 10% margin
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions(threads=2))
    assert instance.threads == 1 and _intra_op(instance) == 1
    assert instance.tuned_parameters == {"intra_op_thread_count": "1"}


def test_the_pool_is_kept_when_it_wins_clearly(tmp_path: Path, scripted_timings: list[list[int]]) -> None:
    scripted_timings[:] = [[40_000], [20_000, 40_000]]
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions(threads=2))
    assert instance.threads == 2 and _intra_op(instance) == 2
    assert instance.threads_note is not None and instance.threads_note.startswith("kept 2 threads")
    assert instance.tuned_parameters == {}


def test_a_model_that_is_not_small_is_timed_once(tmp_path: Path, scripted_timings: list[list[int]]) -> None:
    scripted_timings[:] = [[ortb.SMALL_MODEL_NS]]  # no second session is built or timed
    instance = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions(threads=2))
    assert instance.threads == 2 and instance.threads_note is None and _intra_op(instance) == 2


def test_no_probe_when_the_config_sets_threads_or_one_thread_is_planned(
    tmp_path: Path, scripted_timings: list[list[int]]
) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    pinned = BACKEND.load(path, None, BackendOptions(threads=1, parameters={"intra_op_thread_count": "2"}))
    assert pinned.threads == 2 and pinned.threads_note is None and _intra_op(pinned) == 2
    single = BACKEND.load(path, None, BackendOptions(threads=1))
    assert single.threads == 1 and single.threads_note is None


def test_no_probe_for_dynamic_shapes_or_a_one_core_box(
    tmp_path: Path, scripted_timings: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = BACKEND.load(build_conv_dynamic_hw(tmp_path / "conv.onnx"), None, BackendOptions(threads=2))
    assert conv.threads == 2 and conv.threads_note is None  # H and W unknown: no input to time
    monkeypatch.setattr(ortb.os, "cpu_count", lambda: 1)
    mlp = BACKEND.load(build_mlp(tmp_path / "mlp.onnx"), None, BackendOptions(threads=2))
    assert mlp.threads == 2 and mlp.threads_note is None


def test_the_real_probe_measures_both_and_answers_right(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "mlp.onnx")
    instance = BACKEND.load(path, None, BackendOptions(threads=2))
    note = instance.threads_note
    assert note is not None and "with 1 thread" in note and "with 2 threads" in note
    assert instance.threads in (1, 2) and _intra_op(instance) == instance.threads
    assert (instance.tuned_parameters != {}) == (instance.threads == 1)
    _check_answers(instance, path)


def test_probe_feed_fills_the_batch_axis_and_refuses_unknown_dims() -> None:
    from edgeserve.backends.base import ModelIO, TensorSpec

    io = ModelIO((TensorSpec("a", "FP16", (-1, 4)), TensorSpec("b", "INT64", (2,))), ())
    feed = ortb.probe_feed(io)
    assert feed is not None and feed["a"].shape == (1, 4) and feed["a"].dtype == np.float16
    assert feed["b"].shape == (2,) and feed["b"].dtype == np.int64
    assert ortb.probe_feed(ModelIO((TensorSpec("a", "FP32", (-1, -1)),), ())) is None
    assert ortb.probe_feed(ModelIO((TensorSpec("s", "BYTES", (1,)),), ())) is None


class _Tuned:
    def __init__(self, params: dict[str, str], note: str | None = "probe note") -> None:
        self.tuned_parameters = params
        self.threads_note = note


def test_served_config_shows_the_choice_only_when_every_instance_agrees(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = model_config_pb2.ModelConfig(name="m")
    caplog.set_level("INFO", logger="edgeserve.repository")
    _record_tuning([_Tuned({"intra_op_thread_count": "1"})] * 2, config, "model m version 1")  # type: ignore[list-item]
    assert config.parameters["intra_op_thread_count"].string_value == "1"
    assert "model m version 1: probe note" in caplog.text
    split = model_config_pb2.ModelConfig(name="m")
    _record_tuning([_Tuned({"intra_op_thread_count": "1"}), _Tuned({})], split, "m")  # type: ignore[list-item]
    assert "intra_op_thread_count" not in split.parameters
