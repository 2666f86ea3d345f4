"""A registered shared-memory region is used only by the client that registered it (shm/binding.py).

The attack (Triton shares regions by name): a client names a region another client registered, as
the input of an identity model to read its bytes back, or as an output region to overwrite them
(a camera's frames). The server runs as root; the victim and the attacker are real processes of
two other users (`shm_binding_helpers.Session`), each over HTTP, gRPC and ZeroMQ, so the kernel
reports their own credentials.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import RunningServer, wait_until
from shm_binding_helpers import SIZE, Session
from shm_helpers import NOBODY, D
from shm_server_helpers import lan_address, serve, shm_fixtures

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/shm").is_dir(),
    reason="runs the server as root and its clients as two other users",
)

VICTIM = 12346  # neither root nor nobody
SECRET = np.full(D, 4242.0, dtype=np.float32).tobytes()
ATTACK = np.full(D, -1.0, dtype=np.float32).tobytes()
TRANSPORTS = ("http", "grpc", "ipc", "zmq-tcp")  # every way an attacker may try
NOT_FOUND = {"http": "404", "grpc": "NOT_FOUND", "ipc": "NOT_FOUND", "zmq-tcp": "NOT_FOUND"}


public_dir, served = shm_fixtures("shm-bind")


def _key(tag: str) -> str:
    return f"es_bind_{tag}_{uuid.uuid4().hex[:10]}"


def _on(via: str, at: dict[str, str], **step: Any) -> dict[str, Any]:
    """A step over `via` (ipc and zmq-tcp are both the ZeroMQ client)."""
    return {**step, "via": "zmq" if via in ("ipc", "zmq-tcp") else via, "at": at[via]}


def _read(who: Session, via: str, at: dict[str, str], region: str) -> dict[str, Any]:
    return who.step(**_on(via, at, do="echo", region=region, byte_size=SIZE))


def _owned_region(who: Session, via: str, at: dict[str, str], name: str, data: bytes) -> str:
    """`who` creates its own 0600 object holding `data` and registers it as `name` over `via`."""
    key = _key(name)
    assert who.step(do="create", key=key, data=(data + bytes(4096 - SIZE)).hex(), mode=0o600).get("ok")
    answer = who.step(**_on(via, at, do="register", name=name, key=key, byte_size=4096))
    assert answer.get("ok"), answer
    return key


def _assert_refused_like_an_unknown_name(
    answer: dict[str, Any], via: str, name: str, unknown: dict[str, Any]
) -> None:
    """Refused with exactly what a name nobody registered gets: nothing tells the region exists."""
    assert "data" not in answer and answer["error"] == NOT_FOUND[via], answer
    assert answer["message"] == unknown["message"].replace(unknown["name"], name), (answer, unknown)


def _never(who: Session, via: str, at: dict[str, str]) -> dict[str, Any]:
    name = f"never-{uuid.uuid4().hex[:8]}"
    return {**_read(who, via, at, name), "name": name}


@pytest.mark.parametrize("victim_via", ["http", "grpc", "ipc"])
def test_another_user_can_neither_read_overwrite_list_nor_drop_a_region(
    served: tuple[RunningServer, dict[str, str]], victim_via: str
) -> None:
    running, at = served
    name = f"frames-{victim_via}"
    with Session(VICTIM) as victim, Session(NOBODY) as attacker:
        key = _owned_region(victim, victim_via, at, name, SECRET)
        try:
            assert bytes.fromhex(_read(victim, victim_via, at, name)["data"]) == SECRET  # its own: fine
            for via in TRANSPORTS:
                unknown = _never(attacker, via, at)
                _assert_refused_like_an_unknown_name(_read(attacker, via, at, name), via, name, unknown)
                write = attacker.step(**_on(via, at, do="overwrite", out_region=name, data=ATTACK.hex()))
                assert write["error"] == NOT_FOUND[via] and f"'{name}'" in write["message"], write
                assert name not in attacker.step(**_on(via, at, do="status"))["names"]
                by_name = attacker.step(**_on(via, at, do="status", name=name))
                assert by_name["error"] == NOT_FOUND[via], by_name
                # answered as for an unknown name (Triton's way), and nothing goes
                assert attacker.step(**_on(via, at, do="unregister", name=name)).get("ok")
                assert attacker.step(**_on(via, at, do="unregister", name="")).get("ok")
            assert (Path("/dev/shm") / key).read_bytes()[:SIZE] == SECRET  # not overwritten
            assert name in running.shm_regions()
            assert bytes.fromhex(_read(victim, victim_via, at, name)["data"]) == SECRET
            # names are per user: the attacker's own region of that name is its own, the victim's stays
            _owned_region(attacker, victim_via, at, name, ATTACK)
            assert bytes.fromhex(_read(attacker, victim_via, at, name)["data"]) == ATTACK
            assert bytes.fromhex(_read(victim, victim_via, at, name)["data"]) == SECRET
            assert "Traceback" not in running.log()
        finally:
            for who in (victim, attacker):
                if victim_via != "ipc":  # Triton-protocol regions outlive their client
                    who.step(**_on(victim_via, at, do="unregister", name=""))
    assert name not in running.shm_regions()


def test_a_camera_ring_is_its_own_sockets_alone(served: tuple[RunningServer, dict[str, str]]) -> None:
    """edgeserve's FrameRing over ZeroMQ ipc: no other client, not even another socket of the same
    user, reads or writes it; the camera's own socket does."""
    running, at = served
    frame = np.linspace(0, 1, D, dtype=np.float32).tobytes()
    with Session(VICTIM) as camera, Session(NOBODY) as attacker, Session(VICTIM) as sibling:
        ring = camera.step(do="camera", at=at["ipc"], data=frame.hex())
        assert ring.get("ok"), ring
        before = camera.step(do="camera_bytes")["data"]
        assert frame.hex() in before
        for who, vias in ((attacker, TRANSPORTS), (sibling, ("ipc",))):
            for via in vias:
                unknown = _never(who, via, at)
                _assert_refused_like_an_unknown_name(
                    _read(who, via, at, ring["name"]), via, ring["name"], unknown
                )
                write = who.step(**_on(via, at, do="overwrite", out_region=ring["name"], data=ATTACK.hex()))
                assert write["error"] == NOT_FOUND[via], write
                assert ring["name"] not in who.step(**_on(via, at, do="status"))["names"]
                assert who.step(**_on(via, at, do="unregister", name=ring["name"])).get("ok")
        assert camera.step(do="camera_bytes")["data"] == before  # no byte changed
        assert ring["name"] in running.shm_regions()
        mine = camera.step(**_on("ipc", at, do="status"))["names"]
        assert mine == [ring["name"]]
        assert _read(camera, "ipc", at, ring["name"])["data"] == before[: 2 * SIZE]  # its own socket
    assert ring["name"] not in running.shm_regions()  # went with the camera's socket


def test_a_root_client_sees_and_drops_only_its_own_regions(
    served: tuple[RunningServer, dict[str, str]],
) -> None:
    """Root gets no reach into other users' regions (it may register any memory itself instead), so
    a root application's "unregister all" no longer takes every other client's regions with it."""
    running, at = served
    with Session(VICTIM) as victim, Session(0) as root:
        _owned_region(victim, "http", at, "victims", SECRET)
        try:
            _owned_region(root, "http", at, "roots", ATTACK)
            assert root.step(**_on("grpc", at, do="status"))["names"] == ["roots"]
            assert _read(root, "grpc", at, "victims")["error"] == "NOT_FOUND"
            assert root.step(**_on("http", at, do="unregister", name="")).get("ok")
            assert "roots" not in running.shm_regions() and "victims" in running.shm_regions()
            assert (
                bytes.fromhex(_read(victim, "grpc", at, "victims")["data"]) == SECRET
            )  # HTTP and gRPC alike
        finally:
            victim.step(**_on("http", at, do="unregister", name=""))


def test_a_network_client_is_bound_to_its_address(served: tuple[RunningServer, dict[str, str]]) -> None:
    """A client whose user the server cannot know (here: HTTP from the LAN address) is bound to its IP
    address: neither the box's own clients nor it can name each other's regions."""
    running, at = served
    lan = lan_address()
    if lan is None:
        pytest.skip("this host has no address beyond loopback")
    at = {**at, "http-lan": f"{lan}:{running.http_port}"}
    keys = [_key("lan"), _key("box")]
    for key in keys:  # the server's own objects: what a client of unknown user may register
        with open(f"/dev/shm/{key}", "xb") as created:
            created.truncate(4096)
    try:
        with Session(0) as client:  # root, but over a transport that cannot show it
            for where, name, key in (("http-lan", "from-lan", keys[0]), ("http", "from-box", keys[1])):
                answer = client.step(
                    do="register", via="http", at=at[where], name=name, key=key, byte_size=4096
                )
                assert answer.get("ok"), answer
            try:
                assert client.step(
                    do="echo", via="http", at=at["http-lan"], region="from-lan", byte_size=SIZE
                )["ok"]
                for where, other in (("http-lan", "from-box"), ("http", "from-lan")):
                    refused = client.step(do="echo", via="http", at=at[where], region=other, byte_size=SIZE)
                    assert refused["error"] == "404", (where, refused)
                    listed = client.step(do="status", via="http", at=at[where])["names"]
                    assert other not in listed and len(listed) == 1, listed
            finally:
                for where in ("http-lan", "http"):
                    client.step(do="unregister", via="http", at=at[where], name="")
        assert not {"from-lan", "from-box"} & running.shm_regions()
    finally:
        for key in keys:
            Path(f"/dev/shm/{key}").unlink(missing_ok=True)


def test_the_triton_setting_shares_regions_by_name_again_and_changes_live(
    tmp_path_factory: pytest.TempPathFactory, public_dir: Path
) -> None:
    """[shm] registration = "triton": any client names any region, as Triton (the attack works); a
    SIGHUP back to "peer-credentials" binds the regions already registered to their clients."""
    tmp = tmp_path_factory.mktemp("shm-bind-triton")
    config = tmp / "edgeserve.toml"
    config.write_text('[shm]\nregistration = "triton"\n')
    running, at = serve(tmp, public_dir, extra=("--config", str(config)))
    try:
        with Session(VICTIM) as victim, Session(NOBODY) as attacker:
            key = _owned_region(victim, "http", at, "frames", SECRET)
            ring = victim.step(do="camera", at=at["ipc"], data=SECRET.hex())
            assert bytes.fromhex(_read(attacker, "grpc", at, "frames")["data"]) == SECRET  # the old leak
            assert "frames" in attacker.step(**_on("http", at, do="status"))["names"]
            assert ring["name"] in attacker.step(**_on("ipc", at, do="status"))["names"]
            taken = attacker.step(**_on("http", at, do="register", name="frames", key=key, byte_size=4096))
            assert taken["error"] == "400" and "already in manager" in taken["message"], (
                taken
            )  # names are global
            assert attacker.step(
                **_on("http", at, do="overwrite", out_region="frames", data=ATTACK.hex())
            ).get("ok")
            assert (Path("/dev/shm") / key).read_bytes()[:SIZE] == ATTACK
            config.write_text('[shm]\nregistration = "peer-credentials"\n')
            running.process.send_signal(signal.SIGHUP)
            assert wait_until(lambda: "applied live: shm.registration" in running.log(), 30)
            assert _read(attacker, "grpc", at, "frames")["error"] == "NOT_FOUND"
            assert _read(attacker, "ipc", at, ring["name"])["error"] == "NOT_FOUND"
            assert bytes.fromhex(_read(victim, "grpc", at, "frames")["data"]) == ATTACK  # still the victim's
            victim.step(**_on("http", at, do="unregister", name=""))
        assert running.alive()
    finally:
        running.stop()
