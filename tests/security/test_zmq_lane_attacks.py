"""Attacks on the ZeroMQ frontend's lane (edgeserve/frontends/zmq/lane.py, docs/security.md): a local
process that reaches the lane socket connects without the token the server gave a client over its
ZeroMQ socket, with a token that was issued to another user, with one already used, or holds a
client's routing id to have that client's replies come over its own lane. Each is refused: the
connection is closed unanswered, nothing is run, and no reply goes where it was not asked for."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends" / "zmq"))
from zmq_harness import RunningFrontend, identity_model, running_frontend

from edgeserve.client import ZmqClient
from edgeserve.frontends.zmq.lane import LANES_PER_CLIENT, OP_LANE, Lanes, decode, encode

OTHER_USER = 64991  # a uid of no one on the box
WAIT_S = 30.0  # generous: a busy 2-vCPU CI box

# Connects to the lane as the uid given (when given), sends one packet and says what came back.
ATTACKER = r"""
import json, os, socket, sys
from edgeserve.frontends.zmq.lane import decode, encode
path, payload, uid = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgroups([]); os.setgid(65534); os.setuid(uid)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(30)
sock.connect(path)
sock.sendmsg(encode([payload]))
answers = []
while True:  # until the server closes: a refused lane is closed unanswered
    packet = sock.recv(1 << 20)
    if not packet:
        break
    answers.append([bytes(f).decode("latin-1") for f in decode(memoryview(packet))])
    if answers[-1] != ["ok"]:
        break  # the answer to its request: a bound lane stays open
    sock.sendmsg(encode([b'{"v":1,"op":"infer","id":1,"model":"ident","inputs":[]}']))
print(json.dumps({"uid": os.getuid(), "answers": answers}))
"""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningFrontend]:
    folder = Path(tempfile.mkdtemp(prefix="esa-", dir="/tmp"))  # short: socket paths are <= 107 bytes
    try:
        with running_frontend([identity_model("ident", "FP32")], f"ipc://{folder}/fe.zmq") as running:
            yield running
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _lanes(server: RunningFrontend) -> Lanes:
    lanes = server.frontend._lanes
    assert lanes is not None
    return lanes


def _attack(server: RunningFrontend, payload: bytes, uid: int = -1) -> dict[str, Any]:
    path = str(_lanes(server).path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", ATTACKER, path, payload.hex(), str(uid)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _token(client: ZmqClient) -> bytes:
    return bytes.fromhex(client._call(OP_LANE, None)["token"])


def test_a_connection_without_a_valid_token_is_closed_and_runs_nothing(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    requests, refused, handled = lanes.requests, lanes.refused, server.frontend.counters()["requests"]
    guessed = os.urandom(16)
    request = b'{"v":1,"op":"infer","id":1,"model":"ident","inputs":[]}'  # a request as the first packet
    for payload in (guessed, request, b""):
        assert _attack(server, payload)["answers"] == []  # closed, nothing said
    assert lanes.refused == refused + 3
    assert lanes.requests == requests and lanes.open == 0
    assert server.frontend.counters()["requests"] == handled  # no request reached the frontend


@pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")
def test_a_token_shown_by_another_user_is_refused(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    folder = lanes.path.parent
    folder.chmod(0o711)  # as the service's group would reach it (the socket is 0660)
    lanes.path.chmod(0o666)
    try:
        with ZmqClient(server.endpoint, timeout=WAIT_S, lane=False) as client:
            token = _token(client)  # issued to this client's socket, as root
            requests, refused = lanes.requests, lanes.refused
            seen = _attack(server, token, OTHER_USER)
            assert seen == {"uid": OTHER_USER, "answers": []}
            assert lanes.refused == refused + 1 and lanes.requests == requests and lanes.open == 0
            assert _attack(server, token)["answers"] == []  # and the token is spent: not even its owner
    finally:
        lanes.path.chmod(0o660)
        folder.chmod(0o700)


def test_a_token_is_good_once(server: RunningFrontend) -> None:
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S, lane=False) as client:
        token = _token(client)
        first = _attack(server, token)["answers"]
        assert first[0] == ["ok"] and '"id":1' in first[1][0]  # bound: its request was answered there
        refused = lanes.refused
        assert _attack(server, token)["answers"] == []
        assert lanes.refused == refused + 1


def test_a_lane_carries_no_reply_to_a_request_it_did_not_carry(server: RunningFrontend) -> None:
    """A process holding a client's routing id opens a lane for it; the client (back on that id)
    sends its requests over ZeroMQ: their replies come to it there, never over the other's lane."""
    lanes = _lanes(server)
    ident = os.urandom(16)
    with ZmqClient(server.endpoint, timeout=WAIT_S, identity=ident) as squatter:
        squatter.create_ring(slots=2, slot_size=4096)
        assert squatter.lane_open
        squatter_lane = squatter._link.lane
        assert squatter_lane is not None
        with ZmqClient(server.endpoint, timeout=WAIT_S, identity=ident, lane=False) as victim:
            requests = lanes.requests
            for i in range(5):
                x = np.full((1, 8), i, np.float32)
                np.testing.assert_array_equal(victim.infer("ident", {"INPUT0": x}).as_numpy("OUTPUT0"), x)
            assert lanes.requests == requests
            assert squatter_lane.recv() is None  # nothing came over its lane


def test_a_client_opening_lane_after_lane_keeps_only_its_newest(server: RunningFrontend) -> None:
    """Server fds stay bounded: past LANES_PER_CLIENT the client's oldest lane is closed."""
    lanes = _lanes(server)
    with ZmqClient(server.endpoint, timeout=WAIT_S, lane=False) as client:
        opened = []
        for _ in range(LANES_PER_CLIENT + 2):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(WAIT_S)
            sock.connect(str(lanes.path))
            packet = encode([_token(client)])
            assert packet is not None
            sock.sendmsg(packet)
            assert [bytes(f) for f in decode(memoryview(sock.recv(1 << 16)))] == [b"ok"]
            opened.append(sock)
        try:
            mine = [lane for lane in list(lanes._lanes.values()) if lane.ident == client.identity]
            assert len(mine) == LANES_PER_CLIENT
            for sock in opened[:2]:  # the two oldest were closed by the server
                assert sock.recv(1 << 16) == b""
        finally:
            for sock in opened:
                sock.close()
