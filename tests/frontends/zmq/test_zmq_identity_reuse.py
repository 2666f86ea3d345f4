"""A client that reuses another (gone) client's identity, as a restarted camera process does to keep
its shared-memory regions, receives the replies still owed to that identity. Request IDs tell them
apart: each client starts its IDs at a random point, so a reply meant for the old process is
dropped by the new one instead of answering the new one's request of the same number."""

from __future__ import annotations

import numpy as np
import pytest
from es_server import wait_until
from zmq_harness import RunningFrontend, gate, ungate

from edgeserve.client import ZmqClient
from edgeserve.frontends.zmq.server import _Peer


def test_a_reused_identity_never_gets_the_old_clients_answer(server: RunningFrontend) -> None:
    identity = b"camera-7"
    event = gate(server, "gated")
    try:
        old = ZmqClient(server.endpoint, timeout=5.0, identity=identity)
        old.ping()
        old.submit("gated", {"INPUT0": np.full((1, 4), 111.0, np.float32)})
        assert wait_until(lambda: server.frontend.counters()["inflight"] == 1)
        old.close()  # the process ends with its request still in flight
        new = ZmqClient(server.endpoint, timeout=5.0, identity=identity)
        new.ping()  # connected: the old request's reply now routes to this socket
    finally:
        ungate(server, "gated", event)
    try:
        assert wait_until(lambda: server.frontend.counters()["inflight"] == 0)  # that reply went out
        result = new.infer("id_fp32", {"INPUT0": np.full((1, 4), 222.0, np.float32)})
        assert result["OUTPUT0"].tolist() == [[222.0] * 4]  # before: 111.0, the old client's answer
        assert new.ping()["ready"] is True
    finally:
        new.close()


def test_each_client_starts_its_request_ids_somewhere_else(server: RunningFrontend) -> None:
    firsts = []
    for _ in range(3):
        with ZmqClient(server.endpoint, timeout=5.0) as client:
            firsts.append(client._next_id)
            client.ping()
    assert len(set(firsts)) == 3 and all(0 < first < 2**53 for first in firsts)


class _Frame:
    """A received frame as far as the frontend asks it who sent it (None: no metadata)."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def get(self, name: str) -> str:
        if self.address is None or name != "Peer-Address":
            raise KeyError(name)
        return self.address


def test_a_socket_names_regions_as_whoever_sent_each_message(server: RunningFrontend) -> None:
    """Each message says who sent it (a routing id taken over by another connection lends nothing);
    a socket's requests from one address share the lookup of that address's identity."""
    frontend = server.frontend
    if not frontend._peer_credentials:
        pytest.skip("this libzmq reports no ipc peer credentials")
    peer = _Peer(b"camera-9", [b"camera-9"])
    first = frontend._shm_client(peer, _Frame("localhost:1000:1000:41"))
    assert first.principal == "uid:1000" and first.owner == peer.owner
    assert frontend._shm_client(peer, _Frame("localhost:1000:1000:41")) is first
    other = frontend._shm_client(peer, _Frame("localhost:2000:2000:42"))
    assert other.principal == "uid:2000" and other.owner == peer.owner
    assert frontend._shm_client(peer, _Frame("localhost:1000:1000:41")).principal == "uid:1000"
    unknown = frontend._shm_client(peer, _Frame(None))
    assert unknown.peer is not None and not unknown.peer.known and unknown.principal != "uid:1000"
