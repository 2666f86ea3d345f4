"""Another local user against the ZeroMQ ipc socket's name.

The old default, `ipc:///tmp/edgeserve.zmq`, was a fixed name in the sticky, shared /tmp: another user's
empty file there stopped the server at every start (the service cannot remove it), and a socket of
theirs there received the camera clients' frames and answered them. The default now lives in a folder
only the service user can write (edgeserve/frontends/zmq/endpoint.py); at a configured name in a shared
folder a foreign file stops the server with one clear error, and a client refuses a socket, or a reply,
of anyone but the server's user (edgeserve/client/endpoint.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from es_server import ROOT, SIDE_BY_SIDE_ENV, RunningServer, free_port, get_status, server_command
from onnx_models import write_model
from socket_attacker import finish, run, start

from edgeserve.client import AsyncZmqClient, ClientError, ZmqClient, endpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")

OTHER_USER = 64991  # no one on the box, in no group of the server's
OLD_DEFAULT = Path("/tmp/edgeserve.zmq")
START_S = 120.0  # model load on a loaded 2-core box; a start that fails does so at once


@pytest.fixture
def public(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder every user enters (as /var/lib and /run are), with a shared sticky one inside (as /tmp),
    and this process's environment without a login session or a settings file (no systemd either)."""
    folder = Path(tempfile.mkdtemp(prefix="es-zf-", dir="/tmp"))
    folder.chmod(0o755)
    (folder / "shared").mkdir()
    (folder / "shared").chmod(0o1777)
    for name in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "CONFIGURATION_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("EDGESERVE_ZMQ_ENDPOINTS", raising=False)
    monkeypatch.setenv("EDGESERVE_SERVER_STATE_DIR", str(folder / "state"))
    monkeypatch.setattr(endpoint, "SYSTEM_SETTINGS", folder / "no-settings.toml")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _serve(public: Path, zmq: list[str], *, ready: bool = True) -> RunningServer:
    """`edgeserve serve` with `zmq` as its --zmq-endpoint flags (none: the default); waits until
    it is ready, or until it exits when `ready` is False."""
    repo = public / "repo"
    if not repo.exists():
        write_model(repo, "mlp", "mlp")
    http_port, grpc_port = free_port(), free_port()
    command = server_command("serve", repo, http_port, grpc_port, "-", [])
    at = command.index("--zmq-endpoint")
    command[at : at + 2] = [item for e in zmq for item in ("--zmq-endpoint", e)]
    log_path = public / f"server-{http_port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **SIDE_BY_SIDE_ENV}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = RunningServer(process, http_port, grpc_port, ",".join(zmq), log_path, repo, {})
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return server
        if ready and get_status(server.base + "/v2/health/ready") == 200:
            return server
        time.sleep(0.1)
    server.stop()
    raise AssertionError(f"edgeserve neither ready nor stopped in {START_S}s:\n{server.log()}")


def test_another_users_file_at_the_old_or_the_new_default_stops_nothing(public: Path) -> None:
    squatted = not OLD_DEFAULT.exists()  # else someone's file is there already: the same attack
    try:
        if squatted:
            assert run(OTHER_USER, [], "squat", str(OLD_DEFAULT)) == {"ok": True}
        server = _serve(public, [])
        try:
            assert server.alive(), server.log()
            default = public / "state" / "run" / "edgeserve.zmq"
            assert f"zmq frontend listening on ipc://{default}" in server.log()
            # the attacker cannot put a file of theirs at the new name: the folder is the service user's
            assert run(OTHER_USER, [], "squat", str(default)) == {"error": "EACCES"}
            with ZmqClient(timeout=30.0) as client:  # the client finds it where the server put it
                assert client.endpoint == f"ipc://{default}"
                assert client.ping()["server"] == "edgeserve"
        finally:
            server.stop()
    finally:
        if squatted and OLD_DEFAULT.exists():
            assert OLD_DEFAULT.stat().st_uid == OTHER_USER  # theirs, untouched
            OLD_DEFAULT.unlink()


def test_a_foreign_file_at_a_configured_endpoint_stops_the_start_with_one_clear_error(public: Path) -> None:
    path = public / "shared" / "es.zmq"
    assert run(OTHER_USER, [], "squat", str(path)) == {"ok": True}
    server = _serve(public, [f"ipc://{path}"], ready=False)
    assert server.process.wait(30) != 0
    log = server.log()
    assert f"{path} exists and is not a socket (owner uid {OTHER_USER})" in log and "remove it" in log, log
    assert path.stat().st_uid == OTHER_USER and path.stat().st_size == 0  # left as it was
    assert [p.name for p in path.parent.iterdir()] == ["es.zmq"]  # no bind folder left behind


def test_a_client_refuses_a_foreign_socket_listening_at_the_configured_endpoint(public: Path) -> None:
    at = f"ipc://{public / 'shared' / 'es.zmq'}"
    impostor = start(OTHER_USER, [], "serve", at)
    try:
        with pytest.raises(ClientError) as info:
            ZmqClient(at, timeout=10.0)
        assert info.value.status == "PERMISSION_DENIED"
        assert f"belongs to uid {OTHER_USER}" in info.value.message and "remove it" in info.value.message

        async def connect_async() -> None:
            AsyncZmqClient(at, timeout=10.0)

        with pytest.raises(ClientError) as info:
            asyncio.run(connect_async())
        assert info.value.status == "PERMISSION_DENIED"
        # `edgeserve watch` (whose clients are these) says so and exits 1, having sent nothing
        clip = public / "clip.mp4"  # never opened: the client comes first
        clip.write_bytes(b"")
        watch = subprocess.run(
            [sys.executable, "-m", "edgeserve", "watch", "--endpoint", at, "--model", "mlp", str(clip)],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert watch.returncode == 1 and f"belongs to uid {OTHER_USER}" in watch.stderr, watch.stderr
    finally:
        assert finish(impostor) == {"received": 0}  # not a frame, not a ping reached it


def test_a_reply_from_a_foreign_socket_that_came_after_the_client_is_refused(public: Path) -> None:
    at = f"ipc://{public / 'shared' / 'late.zmq'}"
    with ZmqClient(at, timeout=30.0) as client:  # nothing there yet: the server may come later
        impostor = start(OTHER_USER, [], "serve", at)
        try:
            with pytest.raises(ClientError) as info:
                client.ping()
            assert info.value.status == "PERMISSION_DENIED"
            assert f"came from uid {OTHER_USER}" in info.value.message
        finally:
            assert finish(impostor) == {"received": 1}  # it got the ping: its answer was refused
