"""Files sent with a load request are bounded, named plainly and read by the model, and none outlive the
process that wrote them (repository/request_files.py, layout.override_path, overrides.sweep).

Each attack is tried as a local user would, with tritonclient over the real HTTP and gRPC repository
APIs of a real server whose limits are small ([repository] load_file_max_bytes 1 MiB,
load_files_max_bytes 2 MiB): a file over the limit, files over the total, a file the model never
reads, hostile file and model names (NUL, control, bidi, surrogate, too long). Each checks the status,
the message (which names the file, escaped) and that nothing was left on disk, not even an empty
folder. A server killed with SIGKILL in the middle of a load leaves its files; the next start removes
them. A Triton user's whole model folder (config.pbtxt, labels, the model and its external data) loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from code_origin_helpers import build_external_add, infer, load
from es_server import RunningServer, start_server, wait_until
from onnx_models import build_add_sub

pytestmark = pytest.mark.timeout(300)
PROTOCOLS = ("http", "grpc")
MiB = 2**20
LIMITS = {
    "EDGESERVE_REPOSITORY_LOAD_FILE_MAX_BYTES": str(MiB),
    "EDGESERVE_REPOSITORY_LOAD_FILES_MAX_BYTES": str(2 * MiB),
}
ORT = json.dumps({"backend": "onnxruntime"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("load_files")
    (tmp / "repo").mkdir()
    running = start_server(tmp / "repo", tmp, env=LIMITS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def onnx(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_add_sub(tmp_path_factory.mktemp("onnx") / "add_sub.onnx").read_bytes()


def _area(server: RunningServer) -> Path:
    return server.repository.parent / "state" / "overrides"


def _refused(server: RunningServer, protocol: str, name: str, config: str | None, files: dict[str, bytes],
             text: str) -> str:  # fmt: skip
    """Load, expect INVALID_ARG with `text`; nothing of the request is left on disk, the server serves."""
    got, message = load(protocol, server, name, config, files)
    assert (got, text in message) == ("INVALID_ARG", True), message
    assert not server.model_ready(name) and server.alive()
    assert not (_area(server) / name).exists(), sorted((_area(server) / name).rglob("*"))
    return message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_file_over_the_limit_is_refused(server: RunningServer, onnx: bytes, protocol: str) -> None:
    name = f"big_{protocol}"
    files = {"1/model.onnx": onnx + b"\0" * MiB}  # a valid model, padded
    message = _refused(server, protocol, name, ORT, files, "is over the limit of 1048576 bytes a file")
    assert f"model '{name}': load file '1/model.onnx'" in message and "load_file_max_bytes" in message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_files_over_the_total_are_refused(server: RunningServer, tmp_path: Path, protocol: str) -> None:
    name = f"many_{protocol}"
    model = build_external_add(tmp_path / "model.onnx", "w.bin").read_bytes()
    files = {"1/model.onnx": model, "1/w.bin": b"\0" * (MiB - 64), "2/model.onnx": model,
             "2/w.bin": b"\0" * (MiB - 64), "3/model.onnx": model, "3/w.bin": b"\0" * (MiB - 64)}  # fmt: skip
    text = "in 6 files is over the limit of 2097152 bytes a request"
    message = _refused(server, protocol, name, ORT, files, text)
    assert "load_files_max_bytes" in message


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_files_the_model_does_not_read_are_refused(server: RunningServer, onnx: bytes, protocol: str) -> None:
    name = f"unused_{protocol}"
    files = {"1/model.onnx": onnx, "1/cache.tar": b"\0" * 4096, "stash/payload": b"x"}
    text = "the model does not read '1/cache.tar', 'stash/payload'"
    message = _refused(server, protocol, name, ORT, files, text)
    assert message.startswith(f"model '{name}': load files")


# file name -> what the refusal says; the config names the file, so only its name is wrong
HOSTILE = {
    "nul": ("mo\x00del.onnx", "holds the character \\x00"),
    "newline": ("model.onnx\nERROR forged log line", "holds the character \\n"),
    "escape": ("\x1b[31mmodel.onnx", "holds the character \\x1b"),
    "bidi": ("\u202excod.onnx", "holds the character \\u202e"),
    "too_long": ("m" * 300 + ".onnx", "is too long"),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_names_are_refused_and_leave_nothing(
    server: RunningServer, onnx: bytes, protocol: str, case: str
) -> None:
    filename, text = HOSTILE[case]
    name = f"hostile_{case}_{protocol}"
    config = json.dumps({"backend": "onnxruntime", "default_model_filename": filename})
    message = _refused(server, protocol, name, config, {f"1/{filename}": onnx}, text)
    assert filename not in message and "\n" not in message  # escaped, so a log line cannot be forged
    assert not any(line.startswith("ERROR forged") for line in server.log().splitlines())


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", ["nul\x00model", "new\nline", "bidi\u202eledom"])
def test_hostile_model_names_are_refused(
    server: RunningServer, onnx: bytes, protocol: str, name: str
) -> None:
    got, message = load(protocol, server, name, ORT, {"1/model.onnx": onnx})
    assert got == "INVALID_ARG" and "use a plain folder name" in message, message
    assert server.alive() and not any(p.name.startswith(name[:3]) for p in _area(server).iterdir())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_load_that_fails_in_the_runtime_leaves_nothing(server: RunningServer, protocol: str) -> None:
    name = f"garbage_{protocol}"
    got, message = load(protocol, server, name, ORT, {"1/model.onnx": b"not a model"})
    assert got != "OK" and name in message
    assert not server.model_ready(name) and not (_area(server) / name).exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_triton_users_model_folder_loads_and_serves(
    server: RunningServer, tmp_path: Path, protocol: str
) -> None:
    name = f"folder_{protocol}"
    model = build_external_add(tmp_path / "model.onnx", "weights/w.bin", tmp_path / "w.bin")
    config = {"backend": "onnxruntime", "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4],
              "label_filename": "labels.txt"}]}  # fmt: skip
    files = {"config.pbtxt": b'backend: "onnxruntime"\n', "labels.txt": b"a\nb\nc\nd\n",
             "1/model.onnx": model.read_bytes(),
             "1/weights/w.bin": (tmp_path / "w.bin").read_bytes()}  # fmt: skip
    assert load(protocol, server, name, json.dumps(config), files) == ("OK", "")
    assert infer(protocol, server, name, ("X", "Y")) == [0.0, 2.0, 4.0, 6.0]


def test_a_load_killed_half_way_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    """SIGKILL while a load's files are on disk (written, or the runtime reading them): no cleanup
    code runs, so they stay; the next start removes them (and the model is not served)."""
    (tmp_path / "repo").mkdir()
    first = start_server(tmp_path / "repo", tmp_path, env=LIMITS)
    model = build_external_add(tmp_path / "model.onnx", "w.bin").read_bytes()
    files = {"1/model.onnx": model, "1/w.bin": os.urandom(MiB - 64),
             "2/model.onnx": model, "2/w.bin": b"\0" * 16}  # fmt: skip
    area = tmp_path / "state" / "overrides"

    def loads() -> None:
        with contextlib.suppress(Exception):  # the server dies under it: the connection closes
            load("http", first, "killed", ORT, files)

    loading = threading.Thread(target=loads, daemon=True)
    loading.start()
    try:
        # Generous: a slow box writes 1 MiB well within it; the wait ends as soon as the folder is there.
        assert wait_until(lambda: any((area / "killed").glob("*/1")), timeout=120)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(60)
    finally:
        first.stop()
    loading.join(120)
    assert any((area / "killed").rglob("*"))  # what the killed load wrote is still there
    second = start_server(tmp_path / "repo", tmp_path, env=LIMITS)
    try:
        assert [p.name for p in area.iterdir()] == [".lock"]
        assert not second.model_ready("killed") and "removed" in second.log()
    finally:
        second.stop()
