"""The ZeroMQ ipc socket: where it lives by default (never a fixed name in /tmp), how the server and
its clients find it alike, its mode whatever the umask, and what may already be at its name."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from zmq_harness import identity_model, running_frontend

from edgeserve.client import ZmqClient, endpoint
from edgeserve.client.endpoint import find_endpoint
from edgeserve.frontends.zmq.endpoint import SYSTEMD_RUNTIME_DIR, client_candidates, server_default


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="esi-", dir="/tmp"))  # unix socket paths are <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private_umask() -> Iterator[None]:
    """The server's own umask (0077): the socket must get its group access explicitly."""
    old = os.umask(0o077)
    yield
    os.umask(old)


@pytest.fixture
def session(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A login session's environment ($XDG_RUNTIME_DIR, no settings file anywhere)."""
    runtime = short_dir / "xdg"
    runtime.mkdir(mode=0o700)
    for name in ("RUNTIME_DIRECTORY", "CONFIGURATION_DIRECTORY", "EDGESERVE_ZMQ_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("EDGESERVE_SERVER_STATE_DIR", str(short_dir / "state"))
    monkeypatch.setattr(endpoint, "SYSTEM_SETTINGS", short_dir / "no-such-settings.toml")
    return runtime


def test_the_default_socket_is_in_a_folder_of_the_service_user_never_in_tmp(tmp_path: Path) -> None:
    state = tmp_path / "state"
    systemd = {"RUNTIME_DIRECTORY": "/run/edgeserve", "XDG_RUNTIME_DIR": "/run/user/0"}
    assert server_default(state, systemd) == Path("/run/edgeserve/edgeserve.zmq")
    assert server_default(state, {"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path(
        "/run/user/1000/edgeserve/edgeserve.zmq"
    )
    assert server_default(state, {}) == state / "run" / "edgeserve.zmq"
    assert server_default(state, {"XDG_RUNTIME_DIR": "relative"}) == state / "run" / "edgeserve.zmq"
    # A client's own $RUNTIME_DIRECTORY is its service's: it looks where the server would put it
    assert client_candidates(state, systemd) == [
        Path("/run/user/0/edgeserve/edgeserve.zmq"),
        SYSTEMD_RUNTIME_DIR / "edgeserve.zmq",
        state / "run" / "edgeserve.zmq",
    ]


def test_server_and_client_meet_at_the_default_and_the_group_may_connect(
    session: Path, private_umask: None
) -> None:
    with running_frontend([identity_model("ident", "FP32")], "", endpoints=[]) as running:
        path = session / "edgeserve" / "edgeserve.zmq"
        assert running.frontend.bound == [f"ipc://{path}"]
        assert stat.S_IMODE(path.stat().st_mode) == 0o660  # under umask 0077: given explicitly
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert find_endpoint() == f"ipc://{path}"
        with ZmqClient(timeout=10.0) as client:
            assert client.endpoint == f"ipc://{path}"
            assert client.ping()["server"] == "edgeserve"
        lane = path.parent / "edgeserve.zmq.lane"  # lane.py: the ipc socket's fast path, its mode too
        assert stat.S_IMODE(lane.stat().st_mode) == 0o660
        assert sorted(p.name for p in path.parent.iterdir()) == ["edgeserve.zmq", lane.name]  # no bind folder
    assert not lane.exists()
    assert not path.exists()


def test_without_a_session_the_default_is_a_private_folder_of_the_state_dir(
    session: Path, monkeypatch: pytest.MonkeyPatch, short_dir: Path
) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    state = short_dir / "state"
    path = state / "run" / "edgeserve.zmq"
    assert server_default(state) == path
    assert find_endpoint() == f"ipc://{path}"  # nothing listens anywhere: the server's own place


def test_clients_take_the_endpoint_the_settings_name(session: Path, short_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    config = short_dir / "edgeserve.toml"
    config.write_text('[zmq]\nendpoints = ["ipc:///run/elsewhere/es.zmq", "tcp://127.0.0.1:5555"]\n')
    assert find_endpoint(config) == "ipc:///run/elsewhere/es.zmq"
    monkeypatch.setenv("CONFIGURATION_DIRECTORY", str(short_dir))  # systemd's, for a client service
    assert find_endpoint() == "ipc:///run/elsewhere/es.zmq"
    monkeypatch.delenv("CONFIGURATION_DIRECTORY")
    monkeypatch.setattr(endpoint, "SYSTEM_SETTINGS", config)  # the systemd install's /etc/edgeserve
    assert find_endpoint() == "ipc:///run/elsewhere/es.zmq"
    monkeypatch.setenv("EDGESERVE_ZMQ_ENDPOINTS", "tcp://127.0.0.1:6000")
    assert find_endpoint() == "tcp://127.0.0.1:6000"


def test_a_stale_socket_of_ours_is_replaced_and_a_live_one_refused(short_dir: Path) -> None:
    path = short_dir / "stale.zmq"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    crashed.bind(str(path))
    crashed.close()  # what a killed server leaves: a socket file nobody listens on
    stale_inode = path.stat().st_ino
    model = identity_model("ident", "FP32")
    with running_frontend([model], f"ipc://{path}"):
        assert path.stat().st_ino != stale_inode
        with ZmqClient(f"ipc://{path}", timeout=10.0) as client:
            assert client.ping()["server"] == "edgeserve"
        with pytest.raises(RuntimeError, match="in use by another running process"), running_frontend(
            [model], f"ipc://{path}"
        ):
            pass
        with ZmqClient(f"ipc://{path}", timeout=10.0) as client:  # the first server still serves
            assert client.ping()["server"] == "edgeserve"


def test_a_file_that_is_no_socket_stops_the_bind_naming_it_and_the_fix(short_dir: Path) -> None:
    path = short_dir / "squatted.zmq"
    path.write_bytes(b"")
    with pytest.raises(RuntimeError) as info, running_frontend([identity_model("ident", "FP32")], f"ipc://{path}"):
        pass
    message = str(info.value)
    assert str(path) in message and "not a socket" in message and "remove it" in message
    assert path.read_bytes() == b"" and sorted(p.name for p in short_dir.iterdir()) == ["squatted.zmq"]


def test_a_folder_made_for_a_configured_endpoint_lets_the_group_reach_the_socket(
    short_dir: Path, private_umask: None
) -> None:
    path = short_dir / "made" / "here" / "es.zmq"
    with running_frontend([identity_model("ident", "FP32")], f"ipc://{path}"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o750
