"""Who may name a registered region ([shm] registration, frontends/shm/binding.py), on the registry
with real /dev/shm objects and client identities as the frontends find them."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgeserve.frontends.peer import PeerIdentity, parse_proc_net_tcp, socket_peer, transport_peer
from edgeserve.frontends.shm.binding import principal_of
from edgeserve.frontends.shm.registry import SharedMemoryRegistry, ShmClient
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import ShmRef

ALICE = PeerIdentity("zmq-ipc", "ipc", 1000, 1000)
BOB = PeerIdentity("tcp-loopback", "127.0.0.1:40001", 1001)
CAROL = PeerIdentity("unix", "unix", 1002, 1002)


@pytest.fixture
def objects() -> Iterator[list[str]]:
    """Three /dev/shm objects any user may read and write, holding b"key0", b"key1", b"key2"."""
    keys = [f"es_bind_{uuid.uuid4().hex[:10]}" for _ in range(3)]
    for i, key in enumerate(keys):
        fd = os.open(f"/dev/shm/{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.fchmod(fd, 0o666)
            os.pwrite(fd, f"key{i}".encode().ljust(4096, b"\0"), 0)
        finally:
            os.close(fd)
    yield keys
    for key in keys:
        Path(f"/dev/shm/{key}").unlink(missing_ok=True)


def read(registry: SharedMemoryRegistry, name: str, client: ShmClient | None) -> bytes:
    with registry.acquire(ShmRef(name, 4), client=client) as lease:
        return bytes(lease.read())


def refused(registry: SharedMemoryRegistry, name: str, client: ShmClient | None, write: bool = False) -> str:
    with pytest.raises(InferenceError) as info:
        registry.acquire(ShmRef(name, 4), write=write, client=client).release()
    assert info.value.status is Status.NOT_FOUND
    return info.value.message


def test_principals() -> None:
    assert principal_of(None) == "in-process"
    assert (
        principal_of(ALICE) == principal_of(PeerIdentity("tcp-loopback", "127.0.0.1:5", 1000)) == "uid:1000"
    )
    assert principal_of(PeerIdentity("unix", "unix", 0, 0)) == "uid:0"
    lan = "host:10.0.0.7"
    assert principal_of(PeerIdentity("tcp", "10.0.0.7:5000")) == lan
    assert principal_of(PeerIdentity("tcp", "::ffff:10.0.0.7:5001")) == lan  # IPv4-mapped: the same host
    assert principal_of(PeerIdentity("zmq-tcp", "10.0.0.7")) == lan  # libzmq gives no port
    assert principal_of(PeerIdentity("tcp-loopback", "127.0.0.1:5")) == "host:127.0.0.1"  # owner not found
    assert principal_of(PeerIdentity("tcp", "fe80::1%eth0:5000")) == "host:fe80::1"
    assert principal_of(PeerIdentity("grpc", "unix:/run/edgeserve.sock")) == "anonymous:grpc"
    assert principal_of(PeerIdentity("zmq-ipc", "ipc")) == "anonymous:zmq-ipc"  # libzmq without credentials


def test_names_are_per_client_and_another_clients_region_is_not_found(objects: list[str]) -> None:
    registry = SharedMemoryRegistry()
    alice, bob, carol = ShmClient(ALICE), ShmClient(BOB), ShmClient(CAROL)
    try:
        registry.register("cam", objects[0], 0, 4096, peer=ALICE)
        registry.register("cam", objects[1], 0, 4096, peer=BOB)  # the same name, its own region
        with pytest.raises(InferenceError) as info:
            registry.register("cam", objects[2], 0, 4096, peer=ALICE)
        assert info.value.status is Status.ALREADY_EXISTS
        assert read(registry, "cam", alice) == b"key0" and read(registry, "cam", bob) == b"key1"
        assert read(registry, "cam", ShmClient(PeerIdentity("tcp-loopback", "127.0.0.1:7", 1000))) == b"key0"
        unknown = refused(registry, "nobody-has-this", carol)
        for stranger in (carol, None, ShmClient(PeerIdentity("unix", "unix", 0, 0))):  # root too
            assert refused(registry, "cam", stranger) == unknown.replace("nobody-has-this", "cam")
            assert refused(registry, "cam", stranger, write=True) == unknown.replace("nobody-has-this", "cam")
        assert [r.key for r in registry.status(client=alice)] == [objects[0]]
        assert registry.status(client=carol) == []
        with pytest.raises(InferenceError) as info:
            registry.status("cam", client=carol)
        assert info.value.status is Status.NOT_FOUND
        registry.unregister("cam", client=carol)  # as an unknown name: nothing goes
        registry.unregister("", client=carol)
        registry.unregister_triton("", client=carol)
        assert sorted(registry.names()) == ["cam", "cam"]
        registry.unregister_triton("", client=bob)  # "unregister all": bob's only
        assert read(registry, "cam", alice) == b"key0"
        refused(registry, "cam", bob)
    finally:
        registry.close()
    assert registry.names() == []


def test_a_zeromq_region_belongs_to_its_socket(objects: list[str]) -> None:
    registry = SharedMemoryRegistry()
    socket_a, socket_b = ShmClient(ALICE, owner="zmq:aa"), ShmClient(ALICE, owner="zmq:bb")
    try:
        registry.register("ring", objects[0], 0, 4096, owner="zmq:aa", peer=ALICE)
        registry.register("triton", objects[1], 0, 4096, peer=ALICE)
        assert read(registry, "ring", socket_a) == b"key0"
        refused(registry, "ring", socket_b)  # another socket of the same user
        refused(registry, "ring", ShmClient(ALICE))  # HTTP/gRPC of the same user
        assert read(registry, "triton", socket_b) == b"key1"  # the user's Triton-protocol regions: yes
        assert {r.name for r in registry.status(client=socket_a)} == {"ring", "triton"}
        assert {r.name for r in registry.status(client=socket_b)} == {"triton"}
        assert {r.name for r in registry.status(owner="", client=ShmClient(ALICE))} == {"triton"}
        # a routing id reused by another user's connection lends it nothing
        refused(registry, "ring", ShmClient(BOB, owner="zmq:aa"))
        assert registry.drop_owner("zmq:aa") == ["ring"]  # the socket went away
        assert registry.names() == ["triton"]
    finally:
        registry.close()


def test_the_triton_setting_shares_names_and_changes_live(objects: list[str]) -> None:
    registry = SharedMemoryRegistry(registration="triton")
    alice, bob = ShmClient(ALICE), ShmClient(BOB)
    try:
        registry.register("cam", objects[0], 0, 4096, peer=ALICE)
        registry.register("ring", objects[1], 0, 4096, owner="zmq:aa", peer=ALICE)
        with pytest.raises(InferenceError) as info:
            registry.register("cam", objects[2], 0, 4096, peer=BOB)  # names are global again
        assert info.value.status is Status.ALREADY_EXISTS
        assert read(registry, "cam", bob) == b"key0" and read(registry, "ring", bob) == b"key1"
        assert read(registry, "ring", ShmClient(BOB, owner="zmq:bb")) == b"key1"
        assert {r.name for r in registry.status(client=ShmClient(BOB, owner="zmq:bb"))} == {"cam", "ring"}
        registry.registration = "peer-credentials"  # what a SIGHUP sets: regions keep their clients
        refused(registry, "cam", bob)
        assert read(registry, "cam", alice) == b"key0"
        registry.register("cam", objects[2], 0, 4096, peer=BOB)
        registry.registration = "triton"  # two regions of one name: each client finds its own first
        assert read(registry, "cam", bob) == b"key2" and read(registry, "cam", alice) == b"key0"
        assert read(registry, "cam", ShmClient(CAROL)) in (b"key0", b"key2")
    finally:
        registry.close()


def test_the_clients_user_is_looked_up_once_and_only_when_it_names_a_region(objects: list[str]) -> None:
    calls: list[int] = []

    def lookup() -> PeerIdentity:  # what reading /proc/net/tcp costs a loopback client
        calls.append(1)
        return ALICE

    registry = SharedMemoryRegistry()
    try:
        registry.register("cam", objects[0], 0, 4096, peer=ALICE)
        client = ShmClient(lookup)
        assert calls == []
        assert read(registry, "cam", client) == b"key0" and read(registry, "cam", client) == b"key0"
        assert calls == [1]
    finally:
        registry.close()


def test_an_http_connection_is_looked_up_once() -> None:
    """aiohttp's transport: the peer of a connection is found once (SO_PEERCRED here), not per request."""

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.asked = sock, 0

        def get_extra_info(self, name: str) -> socket.socket:
            self.asked += 1
            return self.sock

    left, right = socket.socketpair()
    with left, right:
        transport = Transport(left)
        first, second = transport_peer(transport), transport_peer(transport)
        assert first is second and first.uid == os.geteuid() and transport.asked == 1
        assert transport_peer(Transport(left)) == first  # a new connection is looked up again
        assert transport_peer(None).uid is None


def test_a_loopback_socket_is_found_among_rows_of_its_port_only() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as client,
    ):
        accepted = server.accept()[0]
        with accepted:
            port = client.getsockname()[1]
            text = Path("/proc/net/tcp").read_text()
            rows = list(parse_proc_net_tcp(text, port))
            assert rows and all(row.local[1] == port for row in rows)  # the others are not decoded
            assert len(rows) < len(list(parse_proc_net_tcp(text)))  # the listening socket at least
            peer = socket_peer(accepted)
            assert (peer.transport, peer.uid) == ("tcp-loopback", os.geteuid())
