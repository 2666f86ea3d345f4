"""Issue 22, item 7: a client may register only shared memory it could open itself.

The attack: a /dev/shm object that the server's user (root here) can read but the client cannot
(mode 0600, owned by a third user) is registered by a client that names its key, then read back
through an identity model. The server runs as root; the attacking client really runs as `nobody`
(shm_helpers.run_as), so the kernel reports different credentials for its sockets.
"""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import RunningServer, wait_until
from shm_helpers import NOBODY, D, run_as
from shm_objects import shm_object
from shm_server_helpers import lan_address, serve, shm_fixtures

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/shm").is_dir(),
    reason="runs the server as root and a client as nobody",
)

THIRD_USER = 12345  # owns the secret: neither the server's user nor the client's
SECRET = np.full(D, 4242.0, dtype=np.float32).tobytes()
SIZE = len(SECRET)


public_dir, served = shm_fixtures("shm-sec")


def _object(owner: int, mode: int, data: bytes = SECRET) -> contextlib.AbstractContextManager[str]:
    return shm_object(owner, owner, mode, data, prefix="es_sec", size=4096)


@pytest.fixture
def secret() -> Iterator[str]:
    """The victim's object: only its owner (a third user) may read it; root (the server) can."""
    with _object(THIRD_USER, 0o600) as key:
        yield key


def _regions(running: RunningServer) -> set[str]:
    """Every client's regions (a client's own status lists only the regions it may name)."""
    names: set[str] = running.shm_regions()
    return names


def _unchanged(key: str) -> bool:
    return (Path("/dev/shm") / key).read_bytes()[:SIZE] == SECRET


def _register(via: str, at: dict[str, str], name: str, key: str) -> dict[str, Any]:
    transport = "zmq" if via in ("ipc", "zmq-tcp") else via
    return {"do": "register", "via": transport, "at": at[via], "name": name, "key": key, "byte_size": 4096}


def _echo(via: str, at: dict[str, str], region: str, out_region: str | None = None) -> dict[str, Any]:
    transport = "zmq" if via in ("ipc", "zmq-tcp") else via
    step = {"do": "echo", "via": transport, "at": at[via], "region": region, "byte_size": SIZE}
    return {**step, "out_region": out_region} if out_region else step


REFUSED = {
    "ipc": "PERMISSION_DENIED",
    "http": "403",
    "grpc": "PERMISSION_DENIED",
    "zmq-tcp": "PERMISSION_DENIED",
}


@pytest.mark.parametrize("via", ["ipc", "http", "grpc"])
def test_a_local_client_cannot_register_memory_it_could_not_open(
    served: tuple[RunningServer, dict[str, str]], secret: str, via: str
) -> None:
    running, at = served
    name = f"steal-{via}"
    reg, echo, direct = run_as(
        NOBODY, [_register(via, at, name, secret), _echo(via, at, name), {"do": "read", "key": secret}]
    )
    assert direct["error"] == "Permission denied"  # the client could not open it itself...
    assert reg["error"] == REFUSED[via], reg  # ...so the server does not open it for it
    assert secret in reg["message"] and f"uid {NOBODY}" in reg["message"], reg["message"]
    assert "data" not in echo and echo["error"] in ("NOT_FOUND", "404"), echo  # nothing read back
    assert name not in _regions(running) and _unchanged(secret)
    assert "shm registration refused key=" + secret in running.log()
    assert running.alive()


def test_a_forged_peer_address_in_the_zmtp_handshake_lends_no_credentials(
    served: tuple[RunningServer, dict[str, str]], secret: str
) -> None:
    """A raw ZMTP client claims "Peer-Address: localhost:0:0:1" (root) in its READY metadata: libzmq
    keeps the address it computed itself, so the client is still `nobody`."""
    running, at = served
    path = at["ipc"].removeprefix("ipc://")
    steps = [{"do": "forge", "path": path, "peer_address": "localhost:0:0:1", "name": "forged", "key": secret,
              "byte_size": 4096}]  # fmt: skip
    (answer,) = run_as(NOBODY, steps)
    assert answer["error"] == "PERMISSION_DENIED" and f"uid {NOBODY}" in answer["message"], answer
    assert "forged" not in _regions(running) and _unchanged(secret)


@pytest.mark.parametrize("via", ["ipc", "http", "grpc"])
def test_a_client_registers_its_own_memory_and_gets_outputs_there(
    served: tuple[RunningServer, dict[str, str]], via: str
) -> None:
    """What tritonclient's shm utilities and edgeserve clients do: the client's own 0600 objects."""
    _, at = served
    data = np.arange(D, dtype=np.float32).tobytes()
    key_in, key_out = f"es_own_in_{uuid.uuid4().hex[:8]}", f"es_own_out_{uuid.uuid4().hex[:8]}"
    try:
        answers = run_as(
            NOBODY,
            [
                {"do": "create", "key": key_in, "data": (data + bytes(4096 - SIZE)).hex(), "mode": 0o600},
                {"do": "create", "key": key_out, "data": bytes(4096).hex(), "mode": 0o600},
                _register(via, at, f"in-{via}", key_in),
                _register(via, at, f"out-{via}", key_out),
                _echo(via, at, f"in-{via}"),
                _echo(via, at, f"in-{via}", out_region=f"out-{via}"),
            ],
        )
        assert all(answer.get("ok") for answer in answers), answers
        assert bytes.fromhex(answers[4]["data"]) == data
        assert (Path("/dev/shm") / key_out).read_bytes()[:SIZE] == data
        assert (Path("/dev/shm") / key_in).stat().st_uid == NOBODY
    finally:
        for key in (key_in, key_out):
            (Path("/dev/shm") / key).unlink(missing_ok=True)
        if via != "ipc":  # Triton-protocol regions outlive the client
            for region in (f"in-{via}", f"out-{via}"):
                urllib.request.urlopen(
                    urllib.request.Request(
                        f"{served[0].base}/v2/systemsharedmemory/region/{region}/unregister", method="POST"
                    ),
                    timeout=10,
                ).close()


def test_a_camera_ring_of_another_user_is_mapped(served: tuple[RunningServer, dict[str, str]]) -> None:
    """edgeserve.client's FrameRing (a sealed memfd) registered by its own user over ipc: the server
    (another user) reaches it, because the process holding it runs as the client."""
    _, at = served
    data = np.linspace(0, 1, D, dtype=np.float32).tobytes()
    (answer,) = run_as(NOBODY, [{"do": "ring", "at": at["ipc"], "data": data.hex()}])
    assert answer.get("ok") and answer["sealed"] and answer["key"].startswith("memfd:"), answer
    assert bytes.fromhex(answer["data"]) == data


def test_a_region_the_client_may_only_read_takes_no_outputs(
    served: tuple[RunningServer, dict[str, str]],
) -> None:
    running, at = served
    with _object(0, 0o644) as key:  # root's, readable by all, writable only by root
        answers = run_as(
            NOBODY,
            [
                _register("http", at, "ro", key),
                _echo("http", at, "ro"),
                _echo("http", at, "ro", out_region="ro"),
            ],
        )
        try:
            assert answers[0].get("ok") and bytes.fromhex(answers[1]["data"]) == SECRET, answers
            assert answers[2]["error"] == "403" and "may only read it" in answers[2]["message"], answers[2]
            assert _unchanged(key)
        finally:
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{running.base}/v2/systemsharedmemory/region/ro/unregister", method="POST"
                ),
                timeout=10,
            ).close()


def test_clients_of_unknown_user_register_only_the_servers_objects(
    served: tuple[RunningServer, dict[str, str]],
) -> None:
    """ZeroMQ over tcp (even from loopback) and HTTP from a non-loopback address carry no credentials:
    a world-readable object of another user is refused, the server's own object is not."""
    running, at = served
    lan = lan_address()
    vias = ["zmq-tcp"] + (["http-lan"] if lan else [])
    at = {**at, "http-lan": f"{lan}:{running.http_port}"}
    with _object(THIRD_USER, 0o644) as theirs, _object(0, 0o600) as ours:
        for via in vias:
            transport = "http" if via == "http-lan" else via
            steps = [
                {**_register(transport, at, f"theirs-{via}", theirs), "at": at[via]},
                {**_register(transport, at, f"ours-{via}", ours), "at": at[via]},
            ]
            refused, allowed = run_as(0, steps)  # root, but over a transport that cannot show it
            assert refused["error"] == REFUSED.get(transport, "403"), (via, refused)
            assert "user unknown" in refused["message"] and "server's user or group" in refused["message"]
            assert allowed.get("ok"), (via, allowed)
        names = _regions(running)
        assert "theirs-http-lan" not in names and ("ours-http-lan" in names) == bool(lan)
    if lan:  # the LAN client's regions are its address's to remove
        urllib.request.urlopen(
            urllib.request.Request(
                f"http://{at['http-lan']}/v2/systemsharedmemory/unregister", method="POST"
            ),
            timeout=10,
        ).close()
        assert "ours-http-lan" not in _regions(running)


def test_the_triton_setting_restores_the_old_rule_and_changes_live(
    tmp_path_factory: pytest.TempPathFactory, public_dir: Path, secret: str
) -> None:
    """[shm] registration = "triton": whatever the server's user can open, as Triton (the attack works);
    back to "peer-credentials" with a SIGHUP, no restart."""
    tmp = tmp_path_factory.mktemp("shm-triton")
    config = tmp / "edgeserve.toml"
    config.write_text('[shm]\nregistration = "triton"\n')
    running, at = serve(tmp, public_dir, extra=("--config", str(config)))
    try:
        reg, echo = run_as(NOBODY, [_register("http", at, "old", secret), _echo("http", at, "old")])
        assert reg.get("ok"), reg
        assert bytes.fromhex(echo["data"]) == SECRET  # the leak this setting accepts
        config.write_text('[shm]\nregistration = "peer-credentials"\n')
        running.process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "applied live: shm.registration" in running.log(), 30), running.log()[
            -2000:
        ]
        (again,) = run_as(NOBODY, [_register("http", at, "again", secret)])
        assert again["error"] == "403", again
        assert running.alive()
    finally:
        running.stop()
