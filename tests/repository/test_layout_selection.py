"""Layout scanning, version policy, load-file paths, backend selection and warm-up samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from onnx_models import build_identity, build_mlp
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.config import Settings
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository import overrides, warmup
from edgeserve.repository.layout import (
    check_model_name,
    find_artifact,
    is_version_name,
    list_models,
    override_path,
    version_dirs,
)
from edgeserve.repository.selection import DefaultSelector, cpu_budget
from edgeserve.repository.versions import describe, select_versions


def _config(text: str) -> Any:
    return text_format.Parse(text, mc.ModelConfig())


def test_layout_scan(tmp_path: Path) -> None:
    for name in ("1", "2", "10", "01", "0", "v3", "latest"):
        (tmp_path / "m" / name).mkdir(parents=True)
    (tmp_path / "m" / "3").write_text("a file, not a folder")
    (tmp_path / ".cache").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert list_models(tmp_path) == ["m"]
    assert list_models(tmp_path / "missing") == []
    assert sorted(version_dirs(tmp_path / "m")) == [1, 2, 10]
    assert [is_version_name(n) for n in ("1", "42", "01", "0", "-1", "1a", "")] == [
        True, True, False, False, False, False, False,
    ]  # fmt: skip
    (tmp_path / "m" / "1" / "model.xml").write_text("<xml/>")
    assert (
        find_artifact(tmp_path / "m" / "1", ("model.onnx", "model.xml")) == tmp_path / "m" / "1" / "model.xml"
    )
    assert find_artifact(tmp_path / "m" / "2", ("model.onnx",)) is None


@pytest.mark.parametrize("name", ["", ".", "..", ".hidden", "a/b", "a\\b"])
def test_bad_model_names(name: str) -> None:
    with pytest.raises(RepositoryError):
        check_model_name(name)


def test_override_paths() -> None:
    assert str(override_path("file:1/model.onnx")) == "1/model.onnx"
    assert str(override_path("config.pbtxt")) == "config.pbtxt"
    for bad in ("file:/etc/passwd", "../x", "1/../../x", "file:", "a//b", "./a", "~/.ssh/x", "a\\b"):
        with pytest.raises(RepositoryError) as err:
            override_path(bad)
        assert err.value.status is Status.INVALID_ARG


def test_override_files_written_and_pruned(tmp_path: Path) -> None:
    first = overrides.write_files(
        tmp_path / "state", "m", {"file:1/model.onnx": b"abc", "config.pbtxt": b"x"}
    )
    assert first.parent == tmp_path / "state" / "overrides" / "m"
    assert (first / "1" / "model.onnx").read_bytes() == b"abc" and (first / "config.pbtxt").exists()
    second = overrides.write_files(tmp_path / "state", "m", {"1/model.onnx": b"def"})
    assert overrides.prune([first, second], [second]) == [second]
    assert not first.exists() and second.exists()


def test_override_files_fall_back_to_a_temp_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state folder should be")
    target = overrides.write_files(blocker, "m", {"1/model.onnx": b"abc"})
    try:
        assert not target.is_relative_to(blocker) and (target / "1" / "model.onnx").read_bytes() == b"abc"
    finally:
        overrides.remove(target)


def test_version_policies() -> None:
    present = [1, 2, 3, 5]
    assert select_versions(present, _config("")) == ([5], [])
    assert select_versions(present, _config("version_policy { latest { num_versions: 2 } }")) == ([3, 5], [])
    assert select_versions(present, _config("version_policy { all { } }")) == ([1, 2, 3, 5], [])
    specific = _config("version_policy { specific { versions: [ 4, 1, 3 ] } }")
    assert select_versions(present, specific) == ([1, 3], [4])
    assert select_versions([], _config("")) == ([], [])
    assert describe(specific) == "specific [1, 3, 4]" and describe(_config("")) == "latest 1"


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    model_dir = tmp_path / "m"
    build_mlp(model_dir / "1" / "model.onnx")
    return model_dir, model_dir / "1"


def test_default_selector_auto_order_and_fallbacks(tmp_path: Path) -> None:
    model_dir, version_dir = _repo(tmp_path)
    choice = DefaultSelector(Settings(), cpus=8).choose("m", model_dir, version_dir, mc.ModelConfig())
    assert choice.backend_name == "openvino" and choice.model_path == version_dir / "model.onnx"
    assert [f.backend_name for f in choice.fallbacks] == ["onnxruntime"]
    assert (
        choice.options.threads == 8 and choice.options.precision == "fp32" and choice.options.device == "CPU"
    )
    assert choice.options.parameters["ort_memory_arena"] == "auto"  # unset: standard's (fixed shapes: on)
    assert "model.onnx" in choice.reason


def test_default_selector_explicit_backend_and_platform(tmp_path: Path) -> None:
    model_dir, version_dir = _repo(tmp_path)
    settings = Settings()
    settings.runtime.ort_memory_arena = True
    selector = DefaultSelector(settings, cpus=8)
    text = (
        'backend: "onnxruntime" instance_group [ { count: 3 } ] '
        'parameters { key: "k" value: { string_value: "v" } }'
    )
    choice = selector.choose("m", model_dir, version_dir, _config(text))
    assert choice.backend_name == "onnxruntime" and choice.fallbacks == ()
    assert choice.options.threads == 2  # 8 CPUs shared by 3 instances
    assert choice.options.parameters == {
        "ort_memory_arena": "true",
        "ort_allow_spinning": "false",
        "k": "v",
        "pinned_backend": "onnxruntime",
    }
    assert (
        selector.choose("m", model_dir, version_dir, _config('platform: "openvino"')).backend_name
        == "openvino"
    )
    settings.runtime.cpu_threads = 3
    assert selector.choose("m", model_dir, version_dir, _config("")).options.threads == 3
    gpu_config = _config('backend: "onnxruntime" instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]')
    gpu = selector.choose("m", model_dir, version_dir, gpu_config)
    assert gpu.options.device == "GPU:1" and gpu.options.providers == ("CUDAExecutionProvider",)


def test_default_selector_errors(tmp_path: Path) -> None:
    model_dir, version_dir = _repo(tmp_path)
    selector = DefaultSelector(Settings(), cpus=2)
    with pytest.raises(RepositoryError) as platform:
        selector.choose("m", model_dir, version_dir, _config('platform: "ensemble"'))
    assert platform.value.field == "platform" and "'ensemble' is not supported" in platform.value.message
    with pytest.raises(InferenceError) as unknown:
        selector.choose("m", model_dir, version_dir, _config('backend: "nope"'))
    assert "unknown backend 'nope'" in unknown.value.message
    with pytest.raises(RepositoryError) as missing:
        selector.choose(
            "m", model_dir, version_dir, _config('backend: "openvino" default_model_filename: "x.xml"')
        )
    assert "x.xml" in missing.value.message
    empty = model_dir / "2"
    empty.mkdir()
    (empty / "README").write_text("no model here")
    with pytest.raises(RepositoryError) as none:
        selector.choose("m", model_dir, empty, mc.ModelConfig())
    assert none.value.status is Status.NOT_FOUND and "README" in none.value.message


def test_cpu_budget_is_positive() -> None:
    assert 1 <= cpu_budget() <= (len(__import__("os").sched_getaffinity(0)))


WARM = """
name: "m" max_batch_size: 4
input [ {{ name: "x" data_type: {dtype} dims: [ 2, 3 ] }} ]
output [ {{ name: "y" data_type: {dtype} dims: [ 2, 3 ] }} ]
model_warmup [ {{ name: "w" batch_size: 2 count: 3
  inputs {{ key: "x" value: {{ data_type: {dtype} dims: [ 2, 3 ] {source} }} }} }} ]
"""


@pytest.mark.parametrize("dtype", ["TYPE_FP32", "TYPE_INT64", "TYPE_BOOL", "TYPE_STRING"])
@pytest.mark.parametrize("source", ["zero_data: true", "random_data: true", 'input_data_file: "x.bin"'])
def test_warmup_samples(tmp_path: Path, dtype: str, source: str) -> None:
    datatype = datatypes.config_to_protocol(dtype)
    (tmp_path / "warmup").mkdir()
    if datatype == "BYTES":
        expected = np.array([f"s{i}".encode() for i in range(12)], dtype=np.object_).reshape(2, 2, 3)
        payload = datatypes.serialize_bytes(expected)
    else:
        expected = (np.arange(12) % 2).astype(datatypes.numpy_dtype(datatype)).reshape(2, 2, 3)
        payload = expected.tobytes()
    (tmp_path / "warmup" / "x.bin").write_bytes(payload)
    samples = warmup.samples(_config(WARM.format(dtype=dtype, source=source)), tmp_path, "cfg")
    assert len(samples) == 1 and samples[0].count == 3 and samples[0].required
    array = samples[0].inputs["x"]
    assert array.shape == (2, 2, 3)
    if source.startswith("input_data_file"):
        assert array.tolist() == expected.tolist()
    elif source.startswith("zero"):
        assert all(v in (0, False, b"") for v in array.reshape(-1).tolist())
    if datatype == "BYTES":
        assert all(isinstance(v, bytes) for v in array.reshape(-1))


def test_warmup_file_of_the_wrong_size(tmp_path: Path) -> None:
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(b"\x00" * 7)
    config = _config(WARM.format(dtype="TYPE_FP32", source='input_data_file: "x.bin"'))
    with pytest.raises(RepositoryError) as err:
        warmup.samples(config, tmp_path, "models/m/config.pbtxt")
    assert err.value.field == "model_warmup[0].inputs['x'].input_data_file" and "x.bin" in err.value.message


def test_implicit_warmup_and_run(tmp_path: Path) -> None:
    from edgeserve.backends.base import BackendOptions
    from edgeserve.backends.onnxruntime import BACKEND

    config = _config('max_batch_size: 4 input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ 3 ] } ]')
    implicit = warmup.samples(config, tmp_path, "cfg")
    assert len(implicit) == 1 and not implicit[0].required
    assert implicit[0].inputs["INPUT0"].shape == (1, 3)
    instance = BACKEND.load(build_identity(tmp_path / "id.onnx", "BYTES"), config, BackendOptions())
    warmup.run([instance], implicit, "cfg")
    dynamic = _config('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]')
    assert warmup.samples(dynamic, tmp_path, "cfg") == []
    bad = warmup.WarmupSample("w", {"INPUT0": np.array([b"rank 1, the model wants 2"], dtype=np.object_)})
    with pytest.raises(RepositoryError) as err:
        warmup.run([instance], [bad], "models/m/config.pbtxt")
    assert err.value.field == "model_warmup 'w'" and "instance 0" in err.value.message
    warmup.run([instance], [warmup.WarmupSample("w", bad.inputs, required=False)], "cfg")  # only logged
