"""repository/origin.py and onnx_refs.py: what a load's origin lets its files and config do, decided by
how the load was asked for; and the ModelRepository applying it before any backend reads a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_models import build_add_sub, write_model
from repo_helpers import RepoFactory

from edgeserve.backends.base import BackendOptions
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_json, parse_text
from edgeserve.repository.onnx_refs import NotOnnx, external_locations
from edgeserve.repository.origin import (
    Origin,
    Provenance,
    admit,
    check_parameters,
    check_paths,
    check_request_files,
)
from edgeserve.repository.selection import BackendChoice, DefaultSelector

PY = 'backend: "python"\ninput [{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }]\n' \
     'output [{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }]\n'  # fmt: skip


def _refused(call: Any, *args: Any) -> InferenceError:
    with pytest.raises(InferenceError) as raised:
        call(*args)
    return raised.value


def _external(path: Path, location: str, nested: bool = False) -> Path:
    """Y = X + W with W in external data at `location` (inside an If branch when `nested`)."""
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), "W")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])
    if nested:
        const = helper.make_node("Constant", [], ["W"], value=tensor)
        branch = helper.make_graph([const, helper.make_node("Add", ["X", "W"], ["Y"])], "b", [], [y])
        node = helper.make_node("If", ["C"], ["Y"], then_branch=branch, else_branch=branch)
        c = helper.make_tensor_value_info("C", TensorProto.BOOL, [])
        graph = helper.make_graph([node], "g", [c, x], [y])
    else:
        graph = helper.make_graph([helper.make_node("Add", ["X", "W"], ["Y"])], "g", [x], [y], [tensor])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(helper.make_model(graph).SerializeToString())
    return path


# -- onnx_refs -------------------------------------------------------------------------------------
def test_external_locations_are_found_in_initializers_and_subgraphs(tmp_path: Path) -> None:
    assert external_locations(_external(tmp_path / "a.onnx", "w.bin").read_bytes()) == ["w.bin"]
    assert (
        external_locations(_external(tmp_path / "b.onnx", "../x", nested=True).read_bytes()) == ["../x"] * 2
    )
    assert external_locations(build_add_sub(tmp_path / "c.onnx").read_bytes()) == []
    for junk in (b"\x0f", b"\x3a\x10ab", bytes(range(200))):
        with pytest.raises(NotOnnx):
            external_locations(junk)


# -- request files, config paths and parameters -----------------------------------------------------
@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("1/model.py", "Python code"), ("1/x/y/model.py", "Python code"), ("1/m.PYC", "Python code"),
        ("1/model.pt", "TorchScript"), ("1/model.plan", "TensorRT engine"), ("1/a.engine", "TensorRT engine"),
        ("1/libop.so", "native library"), ("1/libop.so.1.2", "native library"),
        ("1/op.dll", "native library"),
        ("1/.engines/k.json", "hidden files"), (".x/1/model.onnx", "hidden files"),
    ],
)  # fmt: skip
def test_request_files_carry_no_code(key: str, text: str) -> None:
    error = _refused(check_request_files, "m", {key: b"x"})
    assert error.status is Status.PERMISSION_DENIED and text in error.message
    assert f"model 'm': load file '{key}'" in error.message


def test_request_model_files_pass() -> None:
    names = ["config.pbtxt", "labels.txt", "1/model.onnx", "1/model.onnx.data", "1/model.xml", "1/model.bin",
             "warmup/in.raw", "2/model.onnx/model.onnx"]  # fmt: skip
    files = dict.fromkeys(names, b"")
    check_request_files("m", files)


@pytest.mark.parametrize(
    "bad", ["x/model.py", "../model.py", "/etc/evil.py", "..", ".hidden", "~/x", "1/../model.py"]
)
def test_config_file_names_are_plain_names(tmp_path: Path, bad: str) -> None:
    for text in (
        f'default_model_filename: "{bad}"',
        f'output [{{ name: "O" label_filename: "{bad}" }}]',
        f'input [{{ name: "I" }}] model_warmup [{{ name: "w" inputs {{ key: "I" value: {{ '
        f'input_data_file: "{bad}" }} }} }}]',
    ):
        error = _refused(check_paths, parse_text(text, "cfg"), "cfg", tmp_path)
        assert error.status is Status.INVALID_ARG and f"'{bad}' must be a file name" in error.message
    backslash = parse_json(json.dumps({"default_model_filename": "..\\evil.py"}), "cfg")
    assert "must be a file name" in _refused(check_paths, backslash, "cfg", tmp_path).message


def test_plain_config_file_names_pass(tmp_path: Path) -> None:
    text = 'default_model_filename: "model_int8.onnx" output [{ name: "O" label_filename: "labels.txt" }]'
    check_paths(parse_text(text, "cfg"), "cfg", tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("custom_op_library", "ops"), ("EXECUTION_ENV_PATH", "env.tar.gz"), ("CONFIG_FILE", "k.xml"),
        ("CACHE_DIR", "c"), ("plugins", "a"), ("OV_EXTENSIONS", "x"),
        ("session.model_external_initializers_file_folder_path", "d"), ("anything", "/etc/passwd"),
        ("anything", "../../x"), ("anything", "libcustom.so"), ("anything", "C:\\x"), ("anything", "~/x"),
    ],
)  # fmt: skip
def test_an_api_config_names_no_file_or_library(key: str, value: str) -> None:
    config = parse_json(json.dumps({"parameters": {key: {"string_value": value}}}), "sent")
    error = _refused(check_parameters, config, "sent")
    assert error.status is Status.PERMISSION_DENIED and f"parameters['{key}']" in error.message
    accel = {"optimization": {"execution_accelerators": {"gpu_execution_accelerator": [
        {"name": "tensorrt", "parameters": {key: value}}]}}}  # fmt: skip
    assert _refused(check_parameters, parse_json(json.dumps(accel), "sent"), "sent").message.startswith(
        "sent: optimization.execution_accelerators.gpu_execution_accelerator[0].parameters"
    )


def test_a_path_the_models_own_config_already_names_is_no_change() -> None:
    text = 'parameters { key: "CONFIG_FILE" value { string_value: "kernels.xml" } }'
    own = parse_text(text, "own")
    check_parameters(parse_text(text, "sent"), "sent", own)  # e.g. bench tune sends config.pbtxt back
    other = parse_text('parameters { key: "CONFIG_FILE" value { string_value: "/tmp/k.xml" } }', "s")
    assert _refused(check_parameters, other, "sent", own).status is Status.PERMISSION_DENIED


def test_tuning_parameters_pass() -> None:
    params = {"NUM_STREAMS": "2", "intra_op_thread_count": "1", "precision": "fp16", "pinned": "true",
              "hang_timeout_s": "1.5", "runtime_choice": "x86: race: onnxruntime/CPU 1 ms"}  # fmt: skip
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    check_parameters(parse_json(json.dumps(config), "sent"), "sent")


# -- admit: which origin may name which code --------------------------------------------------------
def test_request_files_never_name_a_code_backend(tmp_path: Path) -> None:
    for text in ('backend: "python"', 'platform: "pytorch_libtorch"', 'default_model_filename: "x.py"'):
        error = _refused(admit, "m", tmp_path, parse_text(text, "sent"), "sent", Origin.REQUEST_FILES)
        assert error.status is Status.PERMISSION_DENIED and "runs code" in error.message
    onnx = admit("m", tmp_path, parse_text('backend: "onnxruntime"', "s"), "s", Origin.REQUEST_FILES)
    assert onnx.from_load_request


def test_an_api_config_runs_only_the_models_own_code(tmp_path: Path) -> None:
    own = parse_text(PY, "own")
    assert admit("m", tmp_path, parse_text('backend: "python"', "s"), "s", Origin.API_CONFIG, own).own_code
    same = admit("m", tmp_path, parse_text(PY + 'default_model_filename: "model.py"', "s"), "s",
                 Origin.API_CONFIG, own)  # fmt: skip
    assert same.own_code and not same.from_load_request
    for text in (
        PY + 'default_model_filename: "other.py"',
        'platform: "pytorch_libtorch"',
        'default_model_filename: "a.py"',
    ):
        error = _refused(admit, "m", tmp_path, parse_text(text, "s"), "s", Origin.API_CONFIG, own)
        assert error.status is Status.PERMISSION_DENIED and "may not choose which code runs" in error.message
    # The model's own config does not parse: no code may run from the sent one.
    assert _refused(admit, "m", tmp_path, parse_text(PY, "s"), "s", Origin.API_CONFIG, None)
    other = admit("m", tmp_path, parse_text('backend: "openvino"', "s"), "s", Origin.API_CONFIG, own)
    assert not other.own_code  # allowed, but nothing it selects may run code (check_choice)


# -- version folders and backend choices ---------------------------------------------------------------
def _choice(backend: str, path: Path, *fallbacks: BackendChoice) -> BackendChoice:
    return BackendChoice(backend, path, BackendOptions(), "test", fallbacks)


def test_links_out_of_a_version_folder_are_refused(tmp_path: Path) -> None:
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (tmp_path / "evil.py").write_text("")
    (version / "inside.bin").write_bytes(b"")
    (version / "alias.bin").symlink_to(version / "inside.bin")  # inside: fine
    local = Provenance("m", Origin.LOCAL, "cfg")
    local.check_version(1, version, parse_text("", "c"))
    (version / "sub").mkdir()
    (version / "sub" / "model.py").symlink_to(tmp_path / "evil.py")
    error = _refused(local.check_version, 1, version, parse_text("", "c"))
    assert error.status is Status.PERMISSION_DENIED
    assert "model 'm' version 1" in error.message and "outside the version folder" in error.message
    # A version folder that is itself a link (bench tune's repository) is checked where it points.
    (version / "sub" / "model.py").unlink()
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "1").symlink_to(version)
    local.check_version(1, tmp_path / "tune" / "1", parse_text("", "c"))


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../x", "~/x"])
def test_request_onnx_external_data_stays_in_the_folder(tmp_path: Path, location: str) -> None:
    version = tmp_path / "1"
    sent = Provenance("m", Origin.REQUEST_FILES, "sent")
    _external(version / "model.onnx", "w.bin")
    sent.check_version(1, version, parse_text("", "c"))
    _external(version / "model.onnx", location, nested=True)
    error = _refused(sent.check_version, 1, version, parse_text("", "c"))
    assert error.status is Status.PERMISSION_DENIED and "external_data.location" in error.message
    # ...also under a name that is not .onnx, when the config names it
    (version / "model.onnx").rename(version / "weights.dat")
    named = parse_text('default_model_filename: "weights.dat"', "c")
    assert "external_data.location" in _refused(sent.check_version, 1, version, named).message
    Provenance("m", Origin.LOCAL, "cfg").check_version(1, version, named)  # the runtime checks local files


def test_backend_choices_by_origin(tmp_path: Path) -> None:
    onnx, plan, py = tmp_path / "model.onnx", tmp_path / "model.plan", tmp_path / "model.py"
    sent = Provenance("m", Origin.REQUEST_FILES, "sent")
    for code in (_choice("python", py), _choice("tensorrt", plan), _choice("neuron", tmp_path / "model.pt")):
        error = _refused(sent.check_choice, code, tmp_path)
        assert error.status is Status.PERMISSION_DENIED and "came with the load request" in error.message
    chosen = sent.check_choice(_choice("tensorrt", onnx, _choice("python", py), _choice("onnxruntime", onnx)),
                               tmp_path)  # fmt: skip
    assert chosen.options.from_load_request and chosen.backend_name == "tensorrt"
    assert [(f.backend_name, f.options.from_load_request) for f in chosen.fallbacks] == [
        ("onnxruntime", True)
    ]
    changed = Provenance("m", Origin.API_CONFIG, "sent", own_code=False)
    assert (
        "may not choose which code runs"
        in _refused(changed.check_choice, _choice("python", py), tmp_path).message
    )
    assert not changed.check_choice(_choice("onnxruntime", onnx), tmp_path).options.from_load_request
    for provenance in (Provenance("m", Origin.LOCAL, "c"), Provenance("m", Origin.API_CONFIG, "c")):
        assert provenance.check_choice(_choice("python", py), tmp_path).backend_name == "python"
    outside = _refused(
        Provenance("m", Origin.LOCAL, "c").check_choice, _choice("onnxruntime", onnx), tmp_path / "v"
    )
    assert "outside the version folder" in outside.message


# -- the repository applies it, before the selector (whose race runs backends) ---------------------------
class RecordingSelector(DefaultSelector):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.chosen: list[str] = []

    def choose(self, model_name: str, model_dir: Path, version_dir: Path, config: Any) -> BackendChoice:
        self.chosen.append(model_name)
        return super().choose(model_name, model_dir, version_dir, config)


async def test_the_repository_records_origin_and_checks_before_choosing(
    tmp_path: Path, make_repo: RepoFactory
) -> None:
    models = tmp_path / "models"
    write_model(models, "local", "add_sub", config='backend: "onnxruntime"\nmax_batch_size: 8\n')
    write_model(models, "linked", "add_sub")
    (tmp_path / "elsewhere.onnx").write_bytes((models / "linked" / "1" / "model.onnx").read_bytes())
    (models / "linked" / "1" / "model.onnx").unlink()
    (models / "linked" / "1" / "model.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    repo = make_repo(models, load_models=["local"])
    repo.selector = selector = RecordingSelector(repo.settings)
    await repo.start()
    assert repo.get("local").origin == "local"
    await repo.load("local", json.dumps({"backend": "onnxruntime", "max_batch_size": 4}))
    assert repo.get("local").origin == "load-request-config"
    files = {"1/model.onnx": (models / "local" / "1" / "model.onnx").read_bytes()}
    await repo.load("sent", json.dumps({"backend": "onnxruntime"}), files)
    served = repo.get("sent")
    assert served.origin == "load-request-files" and all(
        i.path.is_relative_to(tmp_path / "state" / "overrides" / "sent")
        for i in served.instances  # type: ignore[attr-defined]
    )
    await repo.load("linked")  # the operator's own link to a file elsewhere is followed
    assert repo.get("linked").origin == "local"
    selector.chosen.clear()
    with pytest.raises(InferenceError) as raised:
        await repo.load("sneaky", json.dumps({"default_model_filename": "model.txt", "backend": "python"}),
                        {"1/model.txt": b"raise SystemExit"})  # fmt: skip
    assert raised.value.status is Status.PERMISSION_DENIED
    assert selector.chosen == []  # refused before any backend was chosen (or raced)
    assert not (tmp_path / "state" / "overrides" / "sneaky").exists() or not any(
        (tmp_path / "state" / "overrides" / "sneaky").iterdir()
    )
