"""repository/request_files.py, layout.override_path and overrides.sweep: which files a load request may
carry (names, sizes, the files its model reads) and that nothing an earlier process wrote outlives a
start. Server-level attacks are in tests/security/test_load_request_files.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeserve.backends.base import BACKEND_MODULES, get_backend
from edgeserve.config import ConfigError, RepositorySection, Settings
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository import overrides
from edgeserve.repository.layout import check_model_name, override_path
from edgeserve.repository.request_files import ARTIFACTS, check

LIMITS = RepositorySection(load_files_max_bytes=1000, load_file_max_bytes=600)
ORT = json.dumps({"backend": "onnxruntime"})
Refusal = InferenceError


def _refusal(config: str | None, files: dict[str, bytes], limits: RepositorySection = LIMITS) -> Refusal:
    with pytest.raises(InferenceError) as raised:
        check("m", config, files, limits)
    return raised.value


def test_the_artifact_table_is_each_backends_own() -> None:
    assert set(ARTIFACTS) == set(BACKEND_MODULES)
    for name in BACKEND_MODULES:
        try:
            backend = get_backend(name)
        except InferenceError:
            continue  # not installed here
        assert ARTIFACTS[name] == backend.artifacts, name


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("1/mo\x00del.onnx", "\\x00"), ("1/model\n.onnx", "\\n"), ("1/\x1b[2Jmodel.onnx", "\\x1b"),
        ("1/\u202exnno.onnx", "\\u202e"), ("1/model\u200b.onnx", "\\u200b"), ("1/\ud800.onnx", "\\ud800"),
        ("1/model.onnx\x7f", "\\x7f"),
    ],
)  # fmt: skip
def test_control_and_hidden_characters_are_refused_by_name(key: str, shown: str) -> None:
    error = _refusal(ORT, {key: b"x"})
    assert error.status is Status.INVALID_ARG and f"holds the character {shown}" in error.message
    assert key not in error.message  # shown escaped, never raw


@pytest.mark.parametrize("key", ["1/" + "a" * 256, "/".join(["1", *"abcdefgh"]), "1/" + "é" * 128])
def test_names_too_long_for_a_file_system_are_refused(key: str) -> None:
    with pytest.raises(RepositoryError, match="is too long"):
        override_path(key)


@pytest.mark.parametrize("name", ["a\x00b", "a\nb", "x\u202e", "m" * 256])
def test_hostile_model_names_are_refused(name: str) -> None:
    with pytest.raises(RepositoryError) as raised:
        check_model_name(name)
    assert raised.value.status is Status.INVALID_ARG and "\n" not in raised.value.message


def test_one_file_twice_is_refused() -> None:
    error = _refusal(ORT, {"1/model.onnx": b"", "file:1/model.onnx": b""})
    assert "is sent twice" in error.message


def test_sizes_each_and_in_all() -> None:
    one = _refusal(ORT, {"1/model.onnx": b"x" * 601})
    assert one.status is Status.INVALID_ARG and "601 bytes is over the limit of 600" in one.message
    assert "load_file_max_bytes" in one.message and "'1/model.onnx'" in one.message
    many = _refusal(ORT, {"config.pbtxt": b"", "1/model.onnx": b"x" * 600, "labels.txt": b"x" * 401})
    assert "1001 bytes in 3 files is over the limit of 1000" in many.message
    assert "load_files_max_bytes" in many.message
    check("m", ORT, {"1/model.onnx": b"x" * 600, "config.pbtxt": b"x" * 400}, LIMITS)  # at the limits


def test_the_size_settings_are_validated_at_load() -> None:
    for files, each in ((100, 101), (100, 0), (0, 0)):
        settings = Settings()
        settings.repository.load_files_max_bytes, settings.repository.load_file_max_bytes = files, each
        with pytest.raises(ConfigError, match=r"repository\.load_file_max_bytes"):
            settings.validate("test.toml")
    Settings().validate("defaults")


def _onnx_with_data(location: str) -> bytes:
    """Y = X + W whose W is external data at `location`."""
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), "W")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["X", "W"], ["Y"])], "g", [x], [y], [tensor])
    return bytes(helper.make_model(graph).SerializeToString())


def test_a_triton_users_model_folder_is_what_the_model_reads() -> None:
    config = {"backend": "onnxruntime", "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4],
              "label_filename": "labels.txt"}], "model_warmup": [{"name": "w", "batch_size": 1, "inputs": {
              "X": {"data_type": "TYPE_FP32", "dims": [4], "input_data_file": "x.raw"}}}]}  # fmt: skip
    files = {
        "config.pbtxt": b'backend: "onnxruntime"', "labels.txt": b"a\nb\n", "warmup/x.raw": b"\0" * 16,
        "1/model.onnx": _onnx_with_data("weights/w.bin"), "1/weights/w.bin": b"\0" * 16,
        "2/model.onnx": _onnx_with_data("./w2.bin"), "2/w2.bin": b"\0" * 16,
    }  # fmt: skip
    check("m", json.dumps(config), files, RepositorySection())


@pytest.mark.parametrize(
    ("config", "files"),
    [
        ({"backend": "openvino"}, {"1/model.xml": b"<net/>", "1/model.bin": b""}),
        ({"platform": "openvino", "default_model_filename": "n.xml"}, {"1/n.xml": b"<x/>", "1/n.bin": b""}),
        ({"platform": "onnxruntime_onnx", "default_model_filename": "yolo.onnx"}, {"3/yolo.onnx": b""}),
        ({}, {"1/model.onnx": b"", "1/model.xml": b"", "1/model.bin": b""}),  # automatic: any backend's file
    ],
)  # fmt: skip
def test_each_backends_model_files_pass(config: dict[str, Any], files: dict[str, bytes]) -> None:
    check("m", json.dumps(config), files, RepositorySection())


@pytest.mark.parametrize(
    ("config", "files", "unused"),
    [
        (ORT, {"1/model.onnx": b"", "1/notes.txt": b"", "2/junk.bin": b""}, "'1/notes.txt', '2/junk.bin'"),
        (ORT, {"1/model.onnx": b"", "1/model.xml": b""}, "'1/model.xml'"),  # another backend's file
        (ORT, {"1/model.onnx": b"", "1/model.onnx.data": b""}, "'1/model.onnx.data'"),  # not named by it
        (ORT, {"v1/model.onnx": b"", "01/model.onnx": b""}, "'01/model.onnx', 'v1/model.onnx'"),
        (ORT, {"model.onnx": b""}, "'model.onnx'"),  # not in a version folder
        (json.dumps({"platform": "ensemble"}), {"1/model.onnx": b""}, "'1/model.onnx'"),
        (None, {"1/model.onnx": b"", "config.pbtxt": b'backend: "openvino"', "1/x.bin": b""}, "'1/x.bin'"),
    ],
)  # fmt: skip
def test_files_the_model_does_not_read_are_refused_by_name(
    config: str | None, files: dict[str, bytes], unused: str
) -> None:
    error = _refusal(config, files, RepositorySection())
    assert error.status is Status.INVALID_ARG and f"the model does not read {unused};" in error.message
    assert error.message.startswith("model 'm': load files: ")


def test_many_unused_files_are_counted_not_all_listed() -> None:
    files = {"1/model.onnx": b"", **{f"1/junk{i:02d}": b"" for i in range(20)}}
    error = _refusal(ORT, files, RepositorySection())
    assert "'1/junk07' and 12 more;" in error.message and "junk08" not in error.message


def test_a_sweep_empties_the_area_unless_a_live_process_holds_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    left = state / "overrides" / "m" / "20260101T000000-dead"
    (left / "1").mkdir(parents=True)
    (left / "1" / "model.onnx").write_bytes(b"half")
    (state / "overrides" / "stray").write_bytes(b"")
    sweep = "import sys; from pathlib import Path; from edgeserve.repository import overrides; "
    sweep += "overrides.sweep(Path(sys.argv[1]))"
    # Another live process: this one holds the area, so that process must not touch it.
    held = overrides.write_files(state, "live", {"1/model.onnx": b"serving"})
    assert sorted(p.name for p in (state / "overrides").iterdir()) == [".lock", "live"]  # swept first
    (left / "1").mkdir(parents=True)
    subprocess.run([sys.executable, "-c", sweep, str(state)], check=True, timeout=120)
    assert (held / "1" / "model.onnx").read_bytes() == b"serving" and left.is_dir()
    overrides.release(state)  # this process is gone: the next start sweeps
    subprocess.run([sys.executable, "-c", sweep, str(state)], check=True, timeout=120)
    assert [p.name for p in (state / "overrides").iterdir()] == [".lock"]
