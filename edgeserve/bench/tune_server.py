"""The server `tune` measures: `edgeserve serve` started here on free loopback ports, in explicit
model-control mode, over a temporary repository holding links to the model's files; each candidate
config is loaded through the repository API (POST /v2/repository/models/<m>/load with the config as
a `config` parameter, as Triton's load_model(config=...)). Only this process is stopped, by its id."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from edgeserve.bench.errors import BenchError

START_TIMEOUT_S = 90.0
LOAD_TIMEOUT_S = 300.0


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def resolve_model(model: str, repository: Path) -> Path:
    """MODEL as a folder, else as a name in the repository."""
    direct = Path(model)
    folder = direct if direct.is_dir() else repository / model
    if not folder.is_dir():
        raise BenchError(
            f"model '{model}': no folder {folder} (give a model name in --model-repository or a folder)"
        )
    if not any(p.is_dir() and p.name.isdigit() for p in folder.iterdir()):
        raise BenchError(f"model folder {folder} has no numeric version folder")
    return folder.resolve()


class TuneServer:
    def __init__(self, model_dir: Path, name: str) -> None:
        self.name = name
        self.tmp = Path(tempfile.mkdtemp(prefix="edgeserve-tune-"))
        repo = self.tmp / "repository" / name
        repo.mkdir(parents=True)
        for entry in model_dir.iterdir():
            if entry.name != "config.pbtxt":
                (repo / entry.name).symlink_to(entry)
        config = model_dir / "config.pbtxt"
        if config.is_file():  # copied: the server reads the user's choices; only the name may differ
            text = config.read_text()
            (repo / "config.pbtxt").write_text(text)
        self.http_port, self.grpc_port = _free_port(), _free_port()
        self.zmq_endpoint = f"ipc://{self.tmp}/tune.zmq"
        self.log_path = self.tmp / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def url(self, protocol: str) -> str:
        if protocol.startswith("http"):
            return f"127.0.0.1:{self.http_port}"
        return self.grpc if protocol.startswith("grpc") else self.zmq_endpoint

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "edgeserve",
            "serve",
            "--model-repository",
            str(self.tmp / "repository"),
            "--model-control-mode",
            "explicit",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--zmq-endpoint",
            self.zmq_endpoint,
            "--state-dir",
            str(self.tmp / "state"),
            "--log-level",
            "WARNING",
        ]
        # The server sets its own PDEATHSIG from this pid (edgeserve/cli.py): no preexec_fn, which
        # would run grpc's fork handlers in the child of a process that uses grpc (SIGABRT).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "EDGESERVE_DIE_WITH_PARENT": str(os.getpid())}
        env.pop("CONFIGURATION_DIRECTORY", None)  # the appliance's settings file is not this server's
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the tune server exited with {self.process.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError, ValueError),
                urllib.request.urlopen(self.http + "/v2/health/live", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise BenchError(f"the tune server did not start in {START_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _post(self, path: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.http + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=LOAD_TIMEOUT_S) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = json.loads(detail)["error"]
            raise BenchError(f"{exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise BenchError(f"the tune server did not answer: {exc}\n{self.log_tail()}") from None

    def load(self, config_json: str | None, files: dict[str, bytes] | None = None) -> None:
        """Load (or reload) the model, with this config instead of config.pbtxt when given, and served
        from `files` ("1/model_int8.onnx" -> bytes) alone when given (Triton's load_model(files=))."""
        import base64

        params: dict[str, Any] = {"config": config_json} if config_json else {}
        for path, data in (files or {}).items():
            params[f"file:{path}"] = base64.b64encode(data).decode()
        body: dict[str, Any] = {"parameters": params} if params else {}
        self._post(f"/v2/repository/models/{self.name}/load", body)

    def config(self) -> dict[str, Any]:
        """The model's config as served (auto-completed, Triton's JSON)."""
        with urllib.request.urlopen(f"{self.http}/v2/models/{self.name}/config", timeout=30) as response:
            config: dict[str, Any] = json.loads(response.read())
        return config

    def stop(self, remove: bool = True) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        if remove:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
