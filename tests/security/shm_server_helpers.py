"""The server the shared-memory attacks run against (test_shm_registration.py, test_shm_binding.py): the
identity model, served over HTTP, gRPC and ZeroMQ (ipc in a folder every user reaches, and TCP) on all
interfaces, with the admin endpoints open to the LAN so that the shm rule, not the admin rule, answers."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from es_server import RunningServer, free_port, start_server
from onnx_models import write_model
from shm_helpers import CONFIG, MODEL

Served = tuple[RunningServer, dict[str, str]]  # the server, and its address per transport


def lan_address() -> str | None:
    """An address of this host that is not loopback (where it has one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def public_folder(prefix: str) -> Iterator[Path]:
    """A folder every user can reach, for the ZeroMQ ipc socket (a module fixture's body)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def serve(tmp: Path, public: Path, extra: tuple[str, ...] = ()) -> Served:
    repo = tmp / "repo"
    write_model(repo, MODEL, "identity", config=CONFIG)
    ipc, tcp = f"ipc://{public}/{uuid.uuid4().hex[:8]}.zmq", f"tcp://127.0.0.1:{free_port()}"
    args = ["--zmq-endpoint", ipc, "--zmq-endpoint", tcp, "--host", "0.0.0.0", *extra]
    env = {"EDGESERVE_HTTP_ADMIN_LOOPBACK_ONLY": "false", "EDGESERVE_GRPC_ADMIN_LOOPBACK_ONLY": "false"}
    running = start_server(repo, tmp, args=args, env=env)
    os.chmod(ipc.removeprefix("ipc://"), 0o666)  # local clients of any user may connect
    return running, {"ipc": ipc, "zmq-tcp": tcp, "http": running.http_url, "grpc": running.grpc_url}


def serving(tmp: Path, public: Path) -> Iterator[Served]:
    """`serve`, then a check that the attacks left it running (a module fixture's body)."""
    running, at = serve(tmp, public)
    try:
        yield running, at
    finally:
        assert running.alive(), running.log()[-3000:]
        running.stop()


def shm_fixtures(name: str) -> tuple[Any, Any]:
    """An attack file's module fixtures: `public_dir, served = shm_fixtures(name)` (pytest finds them by
    their names)."""

    @pytest.fixture(scope="module")
    def public_dir() -> Iterator[Path]:
        yield from public_folder(f"es-{name}-")

    @pytest.fixture(scope="module")
    def served(tmp_path_factory: pytest.TempPathFactory, public_dir: Path) -> Iterator[Served]:
        yield from serving(tmp_path_factory.mktemp(name), public_dir)

    return public_dir, served
