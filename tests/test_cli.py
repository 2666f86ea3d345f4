"""The `edgeserve` command as an operator runs it: clear one-line errors, models list/load/unload."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from es_server import ROOT, ServerFactory, free_port
from onnx_models import write_model


def edgeserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeserve", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_port_in_use_is_one_line_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = edgeserve("serve", "--model-repository", str(tmp_path / "repo"), "--http-port", str(port),
                           "--grpc-port", str(free_port()), "--no-zmq")  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("edgeserve: cannot start: http frontend") and "in use" in last
    assert "Traceback" not in result.stderr


def test_missing_repository_and_bad_settings_are_clear(tmp_path: Path) -> None:
    for command in ("serve", "run"):
        result = edgeserve(command, "--model-repository", str(tmp_path / "nope"), "--no-zmq",
                           "--http-port", "0", "--grpc-port", "0")  # fmt: skip
        assert result.returncode == 1, command
        assert "model repository" in result.stderr and "is not a folder" in result.stderr, command
    settings = tmp_path / "edgeserve.toml"
    settings.write_text("[http]\nport = -1\n")
    result = edgeserve("run", "--config", str(settings))
    assert result.returncode == 2
    assert f"{settings}: http.port: -1 is not a TCP port" in result.stderr


def test_models_list_load_unload(tmp_path: Path, server_factory: ServerFactory) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", config='backend: "onnxruntime"\nmax_batch_size: 4\n')
    server = server_factory(repo)
    url = ["--url", server.base]
    listed = edgeserve("models", "list", "--json", *url)
    assert listed.returncode == 0, listed.stderr
    assert [(m["name"], m["state"]) for m in json.loads(listed.stdout)] == [("mlp", "READY")]
    assert edgeserve("models", "unload", "mlp", *url).returncode == 0
    table = edgeserve("models", "list", *url).stdout
    assert "mlp" in table and "UNAVAILABLE" in table
    assert edgeserve("models", "load", "mlp", *url).returncode == 0
    table = edgeserve("models", "list", *url).stdout
    assert "READY" in table
    # the plan under the model: what serves and whether it is final (the config named the backend)
    plan = next(line for line in table.splitlines() if line.strip().startswith("plan ("))
    assert "onnxruntime" in plan and ("(final)" in plan or "(provisional" in plan or "(rule)" in plan), table
    missing = edgeserve("models", "load", "nope", *url)
    assert missing.returncode != 0 and "nope" in missing.stderr and "Traceback" not in missing.stderr


def test_unreachable_server_is_a_clear_error() -> None:
    result = edgeserve("models", "list", "--url", f"http://127.0.0.1:{free_port()}")
    assert (
        result.returncode != 0
        and "cannot reach" in result.stderr
        and "is `edgeserve run` running?" in result.stderr
    )
