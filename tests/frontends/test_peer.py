"""Who is on the other end of a connection (edgeserve/frontends/peer.py): captured /proc rows, and
real sockets of a real other user."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from edgeserve.frontends.peer import (
    PeerIdentity,
    grpc_peer,
    parse_proc_net_tcp,
    socket_peer,
    tcp_peer,
    tcp_socket_owner,
    zmq_peer,
    zmq_peer_credentials_work,
)

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(n: int, local: str, remote: str, state: str, uid: int, inode: int) -> str:
    queues = "00000000:00000000 00:00000000 00000000"
    return f"{n:4}: {local} {remote} {state} {queues} {uid:5} 0 {inode} 1 0 20 4 30 10 -1\n"


# Captured on x86-64 (little endian): addresses are 32-bit words printed in host byte order.
TCP = HEADER + "".join(
    [
        row(0, "0100007F:1F40", "00000000:0000", "0A", 0, 100),  # the server listening on 8000
        row(1, "0100007F:9C40", "0100007F:1F40", "01", 1000, 5555),  # client 40000 -> 8000, uid 1000
        row(2, "0100007F:1F40", "0100007F:9C40", "01", 0, 5556),  # the server's end of it
        row(3, "0100007F:9C41", "0100007F:1F40", "06", 0, 0),  # TIME_WAIT: uid 0, no inode
        row(4, "0100007F:9C44", "0100007F:1F40", "01", 1000, 5557),  # 40004 -> 8000, uid 1000
        row(5, "0100007F:9C44", "0100007F:2328", "01", 0, 5558),  # 40004 reused (SO_REUSEADDR) -> 9000
        row(6, "0200007F:9C45", "0100007F:1F40", "01", 1003, 5559),  # from 127.0.0.2
    ]
)
TCP6 = HEADER + "".join(
    [
        row(
            0,
            "00000000000000000000000001000000:9C42",
            "00000000000000000000000001000000:1F41",
            "01",
            1001,
            7777,
        ),
        row(
            1,
            "0000000000000000FFFF00000100007F:9C43",
            "0000000000000000FFFF00000100007F:1F40",
            "01",
            1002,
            7778,
        ),
    ]
)
little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="rows captured on a little-endian host")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TCP)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    return tmp_path


@little_endian
def test_rows_parse_to_addresses_ports_states_and_owners() -> None:
    rows = list(parse_proc_net_tcp(TCP)) + list(parse_proc_net_tcp(TCP6 + "garbage line\n  9: zz:zz\n"))
    loop, loop6 = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")
    assert rows[1].local == (loop, 40000) and rows[1].remote == (loop, 8000)
    assert (rows[1].state, rows[1].uid, rows[1].inode) == (1, 1000, 5555)
    assert rows[7].local == (loop6, 40002) and rows[7].remote == (loop6, 8001)
    assert rows[8].local == (loop, 40003)  # IPv4-mapped comes back as IPv4
    assert len(rows) == 9  # lines that are not rows are skipped


@little_endian
def test_the_owner_of_a_loopback_clients_socket(proc: Path) -> None:
    loop = ipaddress.ip_address("127.0.0.1")
    assert tcp_socket_owner(loop, 40000, 8000, proc) == 1000
    assert tcp_socket_owner(loop, 40000, None, proc) == 1000
    assert tcp_socket_owner(ipaddress.ip_address("::1"), 40002, 8001, proc) == 1001
    assert tcp_socket_owner(loop, 40003, 8000, proc) == 1002  # a mapped row in tcp6
    assert tcp_socket_owner(loop, 40001, 8000, proc) is None  # TIME_WAIT never lends root
    assert tcp_socket_owner(loop, 40000, 9999, proc) is None  # not connected to this server
    # A second socket on the same port, of another user: known only when the server port tells them apart.
    assert tcp_socket_owner(loop, 40004, 8000, proc) == 1000
    assert tcp_socket_owner(loop, 40004, None, proc) is None
    assert tcp_socket_owner(loop, 40000, 8000, proc / "missing") is None


@little_endian
def test_tcp_and_grpc_peers(proc: Path) -> None:
    assert tcp_peer("127.0.0.1", 40000, 8000, proc).uid == 1000
    assert tcp_peer("::ffff:127.0.0.1", 40000, 8000, proc).uid == 1000
    assert tcp_peer("127.0.0.2", 40005, 8000, proc).uid == 1003  # all of 127/8 is loopback
    lan = tcp_peer("10.0.0.7", 40000, 8000, proc)
    assert lan.uid is None and lan.transport == "tcp" and "user unknown" in lan.describe()
    assert tcp_peer("not-an-ip", 1, 8000, proc).uid is None
    assert grpc_peer("ipv4:127.0.0.1:40000", 8000, proc).uid == 1000
    assert grpc_peer("ipv6:[::1]:40002", 8001, proc).uid == 1001
    assert grpc_peer("ipv4:10.0.0.7:40000", 8000, proc).uid is None
    assert grpc_peer("unix:/run/edgeserve/grpc.sock", None, proc).uid is None  # no credentials over grpc
    assert grpc_peer("", None, proc).uid is None


class _Frame:
    def __init__(self, address: str | None) -> None:
        self.address = address

    def get(self, name: str) -> Any:
        assert name == "Peer-Address"
        if self.address is None:
            raise OSError("no metadata")
        return self.address


def test_zmq_peers() -> None:
    ipc = zmq_peer(_Frame("localhost:1000:1001:4242"), credentials_work=True)
    assert (ipc.transport, ipc.uid, ipc.gid, ipc.pid) == ("zmq-ipc", 1000, 1001, 4242)
    assert zmq_peer(_Frame("localhost:1000:1001:4242"), credentials_work=False).uid is None
    for address in ("127.0.0.1", "2001:db8::1:0:0:1", "fe80::1:2:3", "localhost", "x:localhost:0:0:1"):
        assert zmq_peer(_Frame(address), credentials_work=True).uid is None, address  # tcp peers: no user
    assert zmq_peer(_Frame(None), credentials_work=True).uid is None


def test_this_libzmq_reports_ipc_peer_credentials() -> None:
    assert zmq_peer_credentials_work()


def test_a_failed_libzmq_check_trusts_no_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / ("x" * 120)  # an ipc path longer than a Unix socket address may be
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    assert not zmq_peer_credentials_work()


def test_groups_come_from_the_process_while_it_runs_as_that_user(tmp_path: Path) -> None:
    status = tmp_path / "77" / "status"
    status.parent.mkdir()
    status.write_text(
        "Name:\tcam\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t44 1000 2000\n"
    )
    assert PeerIdentity("zmq-ipc", "ipc", 1000, 1000, 77, tmp_path).groups() == {44, 1000, 2000}
    # The pid now runs as someone else: the account database answers instead (uid 0: root's groups).
    assert 0 in PeerIdentity("zmq-ipc", "ipc", 0, 0, 77, tmp_path).groups()
    assert 44 not in PeerIdentity("zmq-ipc", "ipc", 0, 0, 77, tmp_path).groups()
    assert PeerIdentity("zmq-ipc", "ipc", 4_000_000, 5, None, tmp_path).groups() == {5}  # no account
    assert PeerIdentity("tcp", "10.0.0.7:1").groups() == frozenset()


def test_a_unix_socket_peer_is_its_process() -> None:
    left, right = socket.socketpair()
    with left, right:
        peer = socket_peer(left)
    assert (peer.transport, peer.uid, peer.gid, peer.pid) == ("unix", os.geteuid(), os.getegid(), os.getpid())
    assert socket_peer(None).uid is None


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to be another user"
)
def test_a_real_loopback_client_of_another_user() -> None:
    """A client that is `nobody` for real (bash's /dev/tcp under setpriv), read back from /proc/net."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as server:
            server.bind((host, 0))
            server.listen()
            port = server.getsockname()[1]
            connect = f"exec 3<>/dev/tcp/{host}/{port}; read -t 30 <&3"
            client = subprocess.Popen(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", connect]
            )
            try:
                conn, _ = server.accept()
                with conn:
                    peer = socket_peer(conn)
                    assert peer.transport == "tcp-loopback" and peer.uid == 65534, peer
                    conn.sendall(b"bye\n")
            finally:
                client.wait(30)
