"""Whose memory a client may register ([shm] registration, frontends/shm/access.py), on real /dev/shm
objects of real owners and modes, with the client's identity given as the frontends find it."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

import pytest
from shm_objects import shm_object

from edgeserve.config import ConfigError, load_settings
from edgeserve.frontends.peer import PeerIdentity
from edgeserve.frontends.shm.registry import SharedMemoryRegistry, ShmClient
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import ShmRef

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives /dev/shm objects to other users (chown)")

ALICE, BOB, CAROL = 1000, 1001, 1002
VIDEO = 2000  # a group BOB is in, CAROL too


def local(uid: int, groups: tuple[int, ...], tmp: Path) -> PeerIdentity:
    """A local client whose process (pid 7, under a fake /proc) runs as `uid` with `groups`."""
    status = tmp / str(uid) / "7" / "status"
    status.parent.mkdir(parents=True, exist_ok=True)
    ids = f"\t{uid}" * 4
    status.write_text(f"Uid:{ids}\nGid:{ids}\nGroups:\t{' '.join(map(str, groups))}\n")
    return PeerIdentity("zmq-ipc", "ipc", uid, uid, 7, tmp / str(uid))


def refused(registry: SharedMemoryRegistry, key: str, peer: PeerIdentity | None) -> str:
    with pytest.raises(InferenceError) as info:
        registry.register("r", key, 0, 4096, peer=peer)
    assert info.value.status is Status.PERMISSION_DENIED, info.value.message
    assert f"'{key}' refused" in info.value.message
    assert registry.names() == []
    return info.value.message


def writable(registry: SharedMemoryRegistry, key: str, peer: PeerIdentity | None) -> bool:
    """Registers `key` for `peer`: True when outputs may go there too (it is unregistered again)."""
    registry.register("r", key, 0, 4096, peer=peer)
    client = ShmClient(peer)  # the region is bound to `peer`: its requests name it
    try:
        with registry.acquire(ShmRef("r", 8), client=client) as lease:
            assert bytes(lease.read()) == b"payload!"
        try:
            registry.acquire(ShmRef("r", 8, 16), write=True, client=client).release()
        except InferenceError as exc:
            assert exc.status is Status.PERMISSION_DENIED and "may only read it" in exc.message
            return False
        return True
    finally:
        registry.unregister("r", client=client)
        assert registry.names() == []


def test_a_local_client_gets_what_the_kernel_would_give_it(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry()
    alice, bob, carol = (
        local(ALICE, (), tmp_path),
        local(BOB, (VIDEO,), tmp_path),
        local(CAROL, (VIDEO,), tmp_path),
    )
    root = PeerIdentity("tcp-loopback", "127.0.0.1:5", 0)
    with shm_object(ALICE, VIDEO, 0o600) as key:
        assert writable(registry, key, alice)
        assert "uid 1001 (zmq-ipc) could not open it for reading" in refused(registry, key, bob)
        assert writable(registry, key, root)  # root may open anything
    with shm_object(ALICE, VIDEO, 0o640) as key:
        assert not writable(registry, key, bob)  # by its group: inputs only
        refused(registry, key, PeerIdentity("zmq-ipc", "ipc", 4242, 4242, None))
    with shm_object(ALICE, VIDEO, 0o604) as key:
        refused(registry, key, carol)  # the group's bits apply to a member, not the others' bits
        assert not writable(registry, key, PeerIdentity("tcp-loopback", "127.0.0.1:6", 4242))
    with shm_object(ALICE, VIDEO, 0o066) as key:
        refused(registry, key, alice)  # the owner's bits apply to the owner
    with shm_object(ALICE, VIDEO, 0o666) as key:
        assert writable(registry, key, carol)


def test_a_posix_acl_leaves_the_object_to_its_owner(tmp_path: Path) -> None:
    # user::rw-, user:BOB:---, group::r--, mask::r--, other::r-- (BOB is denied what others get)
    acl = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, ident)
        for tag, perm, ident in (
            (1, 6, 2**32 - 1),
            (2, 0, BOB),
            (4, 4, 2**32 - 1),
            (0x10, 4, 2**32 - 1),
            (0x20, 4, 2**32 - 1),
        )
    )
    registry = SharedMemoryRegistry()
    with shm_object(ALICE, ALICE, 0o644) as key:
        try:
            os.setxattr(f"/dev/shm/{key}", "system.posix_acl_access", acl)
        except OSError:
            pytest.skip("this /dev/shm has no POSIX ACLs")
        assert "POSIX ACL" in refused(registry, key, local(BOB, (), tmp_path))
        assert writable(registry, key, local(ALICE, (), tmp_path))


def test_a_memfd_only_for_the_user_of_the_process_holding_it(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry()
    fd = os.memfd_create("es-acc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 8192)
        os.pwrite(fd, b"payload!", 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        key = f"memfd:es-acc:{os.getpid()}:{fd}"  # held by this process: root's
        assert "held by a process of another user" in refused(registry, key, local(ALICE, (), tmp_path))
        assert writable(registry, key, PeerIdentity("zmq-ipc", "ipc", 0, 0, os.getpid()))
        assert writable(registry, key, None)  # the server's own memfd, for a client of unknown user
    finally:
        os.close(fd)


def test_clients_of_unknown_user_get_only_the_servers_objects_or_prefixed_keys() -> None:
    lan = PeerIdentity("tcp", "10.0.0.7:5000")
    registry = SharedMemoryRegistry()
    with shm_object(ALICE, ALICE, 0o666) as theirs, shm_object(os.geteuid(), ALICE, 0o600) as ours:
        message = refused(registry, theirs, lan)  # world-readable, still not for a LAN peer
        assert "10.0.0.7:5000" in message and "user unknown" in message and "key_prefixes" in message
        refused(registry, theirs, None)  # an in-process caller is held to the same rule
        assert writable(registry, ours, lan)
    with (
        shm_object(ALICE, os.getegid(), 0o640) as group_readable,
        shm_object(ALICE, os.getegid(), 0o600) as group_not,
    ):
        assert writable(registry, group_readable, lan)
        refused(registry, group_not, lan)
    prefixed = SharedMemoryRegistry(key_prefixes=["cam_"])
    with shm_object(ALICE, ALICE, 0o600, prefix="cam") as camera:
        assert writable(prefixed, camera, lan)  # the operator vouched for these keys


def test_the_triton_setting_registers_whatever_the_server_can_open(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry(registration="triton")
    with shm_object(ALICE, ALICE, 0o600) as key:
        assert writable(registry, key, local(BOB, (), tmp_path))
        assert writable(registry, key, PeerIdentity("tcp", "10.0.0.7:5000"))
    registry.registration = "peer-credentials"  # what a SIGHUP reload sets
    with shm_object(ALICE, ALICE, 0o600) as key:
        refused(registry, key, local(BOB, (), tmp_path))


def test_the_setting_is_validated_and_comes_from_the_environment(tmp_path: Path) -> None:
    assert load_settings(environ={}).shm.registration == "peer-credentials"
    assert load_settings(environ={"EDGESERVE_SHM_REGISTRATION": "triton"}).shm.registration == "triton"
    config = tmp_path / "edgeserve.toml"
    config.write_text('[shm]\nregistration = "anyone"\n')
    with pytest.raises(
        ConfigError,
        match=r"edgeserve.toml: shm.registration: 'anyone' is not one of peer-credentials, triton",
    ):
        load_settings(config, environ={})
