"""Code runs only from the local model repository or a signed bundle (DESIGN.md "Trust").

Each attack is tried as an attacker would, over the real HTTP and gRPC repository APIs of a real
server: code sent with a load request (at any folder depth, under any name), a config-only load that
points a local model at a file elsewhere on disk or at another local file, library and path
parameters, a TensorRT engine, ONNX external data outside the folder. Each checks the refusal (status
and text), that the code did not run (the evil model.py writes a marker when imported), that nothing
was left behind (no override folder) and that the local model still serves. The legitimate paths keep
working: a local Python model, ONNX and OpenVINO IR files sent with a load request (with external
data inside the folder). Links the operator put in the model repository are followed
(tests/repository/test_links.py); sizes and names of sent files: test_load_request_files.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from code_origin_helpers import (
    GOOD,
    PY_PBTXT,
    build_external_add,
    evil_source,
    infer,
    load,
    py_config,
)
from es_server import RunningServer, start_server, wait_until
from onnx_models import write_model

pytestmark = pytest.mark.timeout(300)
PROTOCOLS = ("http", "grpc")


@dataclass
class Appliance:
    server: RunningServer
    tmp: Path
    markers: Path
    outside: Path  # a folder outside the repository holding evil.py

    def ran(self) -> list[str]:
        """Markers left by evil code that ran."""
        return sorted(p.name for p in self.markers.iterdir())

    def leftovers(self, name: str) -> list[str]:
        folder = self.tmp / "state" / "overrides" / name
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    tmp = tmp_path_factory.mktemp("code_origin")
    markers = tmp / "markers"
    markers.mkdir()
    outside = tmp / "somewhere"
    outside.mkdir()
    (outside / "evil.py").write_text(evil_source(markers / "somewhere"))
    repo = tmp / "repo"
    # A local Python model, and beside its model.py a local file that is not its code.
    (repo / "local_py" / "1").mkdir(parents=True)
    (repo / "local_py" / "config.pbtxt").write_text(PY_PBTXT)
    (repo / "local_py" / "1" / "model.py").write_text(GOOD)
    (repo / "local_py" / "1" / "other.py").write_text(evil_source(markers / "other"))
    # A local ONNX model with a script beside it.
    write_model(repo, "local_onnx", "add_sub", config='backend: "onnxruntime"\nmax_batch_size: 8\n')
    (repo / "local_onnx" / "1" / "helper.py").write_text(evil_source(markers / "helper"))
    server = start_server(repo, tmp, args=["--load-model", "local_py", "--load-model", "local_onnx"])
    yield Appliance(server, tmp, markers, outside)
    server.stop()


def _after_refusal(appliance: Appliance, name: str) -> None:
    assert appliance.ran() == [], f"code ran: {appliance.ran()}"
    assert appliance.leftovers(name) == []
    assert appliance.server.alive()


def _request_attacks(appliance: Appliance, marker: str) -> dict[str, tuple[str, dict[str, bytes], str, str]]:
    """case -> (config, files, status, text in the refusal)."""
    evil = evil_source(appliance.markers / marker).encode()
    onnx = (appliance.tmp / "add_sub.onnx").read_bytes()
    escaping = build_external_add(appliance.tmp / marker / "escaping.onnx", "../../../../secret.bin")
    return {
        "plain": (py_config(), {"1/model.py": evil}, "PERMISSION_DENIED", "is Python code"),
        "one_folder_deeper": (
            py_config(default_model_filename="x/model.py"), {"1/x/model.py": evil},
            "PERMISSION_DENIED", "is Python code",
        ),
        "deeper_under_another_name": (
            py_config(default_model_filename="x/model.txt"), {"1/x/model.txt": evil},
            "INVALID_ARG", "default_model_filename: 'x/model.txt' must be a file name in the version folder",
        ),
        "under_another_name": (
            py_config(default_model_filename="model.txt"), {"1/model.txt": evil},
            "PERMISSION_DENIED", "runs code",
        ),
        "tensorrt_engine": (
            json.dumps({"backend": "tensorrt"}), {"1/model.plan": b"\x00engine"},
            "PERMISSION_DENIED", "a TensorRT engine (executable code)",
        ),
        "engine_cache": (
            json.dumps({"backend": "onnxruntime"}), {"1/model.onnx": onnx, "1/.engines/k.plan": b"x"},
            "PERMISSION_DENIED", "hidden files and folders are not accepted",
        ),
        "native_library": (
            json.dumps({"backend": "onnxruntime", "model_operations": {"op_library_filename": ["libop.so"]}}),
            {"1/model.onnx": onnx, "1/libop.so": b"\x7fELF"}, "PERMISSION_DENIED", "is a native library",
        ),
        "external_data_outside": (
            json.dumps({"backend": "onnxruntime"}), {"1/model.onnx": escaping.read_bytes()},
            "PERMISSION_DENIED", "external_data.location: '../../../../secret.bin' is outside the version",
        ),
    }  # fmt: skip


REQUEST_CASES = (
    "plain", "one_folder_deeper", "deeper_under_another_name", "under_another_name", "tensorrt_engine",
    "engine_cache", "native_library", "external_data_outside",
)  # fmt: skip


@pytest.fixture(scope="module")
def add_sub_onnx(appliance: Appliance) -> Path:
    from onnx_models import build_add_sub

    return build_add_sub(appliance.tmp / "add_sub.onnx")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", REQUEST_CASES)
def test_code_sent_with_a_load_request_never_runs(
    appliance: Appliance, add_sub_onnx: Path, protocol: str, case: str
) -> None:
    name = f"sent_{case}_{protocol}"
    config, files, status, text = _request_attacks(appliance, name)[case]
    got, message = load(protocol, appliance.server, name, config, files)
    assert (got, text in message) == (status, True), message
    assert name in message  # the refusal names the model
    assert not appliance.server.model_ready(name)
    _after_refusal(appliance, name)


def _config_attacks(appliance: Appliance) -> dict[str, tuple[str, str, str, str]]:
    """case -> (local model, config sent, status, text in the refusal)."""
    evil = appliance.outside / "evil.py"
    onnx_output: dict[str, Any] = {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}
    return {
        "relative_escape": (
            "local_py", py_config(default_model_filename="../../../somewhere/evil.py"),
            "INVALID_ARG", "default_model_filename: '../../../somewhere/evil.py' must be a file name",
        ),
        "absolute_path": (
            "local_py", py_config(default_model_filename=str(evil)),
            "INVALID_ARG", f"default_model_filename: '{evil}' must be a file name",
        ),
        "another_local_file": (
            "local_py", py_config(default_model_filename="other.py"),
            "PERMISSION_DENIED", "may not choose which code runs",
        ),
        "switch_to_python": (
            "local_onnx", json.dumps({"backend": "python", "default_model_filename": "helper.py"}),
            "PERMISSION_DENIED", "may not choose which code runs",
        ),
        "auto_selected_script": (
            "local_onnx", json.dumps({"max_batch_size": 8, "default_model_filename": "helper.py"}),
            "PERMISSION_DENIED", "may not choose which code runs",
        ),
        "op_library": (
            "local_onnx", json.dumps({"backend": "onnxruntime", "model_operations":
                                      {"op_library_filename": [str(appliance.outside / "libop.so")]}}),
            "PERMISSION_DENIED", "model_operations.op_library_filename",
        ),
        "openvino_config_file": (
            "local_onnx", json.dumps({"backend": "openvino", "parameters":
                                      {"CONFIG_FILE": {"string_value": "/tmp/kernels.xml"}}}),
            "PERMISSION_DENIED", "parameters['CONFIG_FILE']: a config sent with a load request may not name",
        ),
        "label_file_elsewhere": (
            "local_onnx", json.dumps({"backend": "onnxruntime", "max_batch_size": 8, "output":
                                      [{**onnx_output, "label_filename": "../" * 16 + "etc/passwd"}]}),
            "INVALID_ARG", "label_filename: '" + "../" * 16 + "etc/passwd' must be a file name",
        ),
    }  # fmt: skip


CONFIG_CASES = (
    "relative_escape", "absolute_path", "another_local_file", "switch_to_python", "auto_selected_script",
    "op_library", "openvino_config_file", "label_file_elsewhere",
)  # fmt: skip


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_sent_over_the_api_does_not_choose_code_or_paths(
    appliance: Appliance, protocol: str, case: str
) -> None:
    model, config, status, text = _config_attacks(appliance)[case]
    got, message = load(protocol, appliance.server, model, config)
    assert (got, text in message) == (status, True), message
    assert model in message
    _after_refusal(appliance, model)
    # A failed reload keeps the model's own version serving.
    if model == "local_py":
        assert infer(protocol, appliance.server, "local_py", ("IN", "OUT")) == [1.0, 2.0, 3.0, 4.0]
    assert appliance.server.model_ready(model)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_local_python_model_runs_and_reloads_with_its_own_config(
    appliance: Appliance, protocol: str
) -> None:
    assert infer(protocol, appliance.server, "local_py", ("IN", "OUT")) == [1.0, 2.0, 3.0, 4.0]
    assert load(protocol, appliance.server, "local_py", py_config()) == ("OK", "")
    assert load(protocol, appliance.server, "local_py") == ("OK", "")
    assert infer(protocol, appliance.server, "local_py", ("IN", "OUT")) == [1.0, 2.0, 3.0, 4.0]
    assert appliance.ran() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_model_files_sent_with_a_load_request_serve(
    appliance: Appliance, protocol: str, backend: str
) -> None:
    """ONNX with its external data beside it (onnxruntime), the same as OpenVINO IR (openvino)."""
    name = f"uploaded_{backend}_{protocol}"
    staging = appliance.tmp / name
    model = build_external_add(staging / "model.onnx", "weights.bin", staging / "weights.bin")
    files = {"1/model.onnx": model.read_bytes(), "1/weights.bin": (staging / "weights.bin").read_bytes()}
    if backend == "openvino":
        from edgeserve.backends.openvino import core, openvino_module

        openvino_module().save_model(core().read_model(str(model)), str(staging / "model.xml"))
        files = {f"1/model{ext}": (staging / f"model{ext}").read_bytes() for ext in (".xml", ".bin")}
    assert load(protocol, appliance.server, name, json.dumps({"backend": backend}), files) == ("OK", "")
    assert infer(protocol, appliance.server, name, ("X", "Y")) == [0.0, 2.0, 4.0, 6.0]
    assert len(appliance.leftovers(name)) == 1  # its files, while it serves
    unload = f"{appliance.server.base}/v2/repository/models/{name}/unload"
    assert _post(unload) == 200 and not appliance.server.model_ready(name)
    assert wait_until(lambda: appliance.leftovers(name) == [])


def _post(url: str) -> int:
    import urllib.request

    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status)
