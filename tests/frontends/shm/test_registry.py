from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import ShmRef


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(name=f"es_test_{uuid.uuid4().hex[:8]}", create=True, size=8192)
    yield shm
    shm.close()
    shm.unlink()


def test_register_read_write_and_never_unlink(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("in", "/" + segment.name, 0, 4096)
    np.frombuffer(segment.buf, dtype=np.float32, count=4)[:] = [1, 2, 3, 4]
    with registry.acquire(ShmRef("in", 16, 0)) as lease:
        assert np.frombuffer(lease.view, dtype=np.float32).tolist() == [1, 2, 3, 4]
        lease.view[0:4] = np.float32(9).tobytes()
    assert np.frombuffer(segment.buf, dtype=np.float32, count=1)[0] == 9
    assert [r.name for r in registry.status()] == ["in"]
    registry.close()
    assert os.path.exists(f"/dev/shm/{segment.name}")  # the client owns the segment


def test_offsets_are_relative_to_the_region(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("tail", segment.name, 4096, 4096)  # non-page-multiple offsets work too
    segment.buf[4096 + 8 : 4096 + 12] = b"abcd"
    with registry.acquire(ShmRef("tail", 4, 8)) as lease:
        assert bytes(lease.view) == b"abcd"
    registry.close()


def test_errors(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", segment.name, 0, 1024)
    cases = [
        (lambda: registry.register("r", segment.name, 0, 16), Status.ALREADY_EXISTS),
        (lambda: registry.register("x", "/no_such_segment_es", 0, 16), Status.NOT_FOUND),
        (lambda: registry.register("x", segment.name, 8000, 1000), Status.INVALID_ARG),
        (lambda: registry.register("x", "///", 0, 16), Status.INVALID_ARG),
        (lambda: registry.acquire(ShmRef("nope", 4)), Status.NOT_FOUND),
        (lambda: registry.acquire(ShmRef("r", 4, 1024)), Status.INVALID_ARG),
        (lambda: registry.acquire(ShmRef("r", 1000, 100)), Status.INVALID_ARG),
        (lambda: registry.status("nope"), Status.NOT_FOUND),
    ]
    for call, status in cases:
        with pytest.raises(InferenceError) as info:
            call()
        assert info.value.status is status, info.value.message
    registry.unregister("unknown-is-fine")
    registry.close()


def test_key_prefix_restriction_and_disabled(segment: shared_memory.SharedMemory) -> None:
    restricted = SharedMemoryRegistry(key_prefixes=["camera_"])
    with pytest.raises(InferenceError) as info:
        restricted.register("r", segment.name, 0, 16)
    assert info.value.status is Status.PERMISSION_DENIED
    disabled = SharedMemoryRegistry(allow_client_shm=False)
    with pytest.raises(InferenceError) as info:
        disabled.register("r", segment.name, 0, 16)
    assert info.value.status is Status.UNSUPPORTED


def test_unregister_while_in_flight_keeps_the_lease_valid(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", segment.name, 0, 64)
    segment.buf[0:3] = b"xyz"
    lease = registry.acquire(ShmRef("r", 3))
    registry.unregister("r")
    assert registry.status() == []
    assert bytes(lease.view) == b"xyz"  # still mapped for the request that holds it
    lease.release()
    with pytest.raises(InferenceError):
        registry.acquire(ShmRef("r", 3))


def test_owner_scoped_unregister(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("a", segment.name, 0, 64, owner="client-1")
    registry.register("b", segment.name, 0, 64, owner="client-2")
    registry.unregister("", owner="client-1")
    assert registry.names() == ["b"]
    registry.close()


def _memfd(name: str, size: int, seals: int) -> int:
    import fcntl

    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_only_a_shrink_sealed_memfd_is_mapped() -> None:
    import fcntl

    registry = SharedMemoryRegistry()
    sealed = _memfd("es-sealed", 8192, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    loose = _memfd("es-loose", 8192, 0)
    try:
        pid = os.getpid()
        registry.register("sealed", f"memfd:es-sealed:{pid}:{sealed}", 0, 8192)
        with registry.acquire(ShmRef("sealed", 4, 8)) as lease:
            assert lease.sealed and isinstance(lease.view, memoryview)  # mapped: zero copy
            lease.write(b"abcd")
            assert os.pread(sealed, 4, 8) == b"abcd" and bytes(lease.read()) == b"abcd"
        with pytest.raises(PermissionError):
            os.ftruncate(sealed, 0)  # what makes mapping it safe
        cases = [
            (f"memfd:es-loose:{pid}:{loose}", Status.INVALID_ARG),  # not sealed against shrinking
            (f"memfd:es-other:{pid}:{sealed}", Status.INVALID_ARG),  # the fd is not the memfd named
            (f"memfd:es-sealed:{pid}:99999", Status.NOT_FOUND),
            ("memfd:es sealed:1:2", Status.INVALID_ARG),
            (f"memfd:stdin:{pid}:0", Status.INVALID_ARG),
        ]
        for key, status in cases:
            with pytest.raises(InferenceError) as info:
                registry.register("x", key, 0, 16)
            assert info.value.status is status, (key, info.value.message)
        assert registry.names() == ["sealed"]
    finally:
        registry.close()
        os.close(sealed)
        os.close(loose)


def test_a_region_that_can_shrink_is_copied_never_mapped(segment: shared_memory.SharedMemory) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", segment.name, 0, 8192)
    segment.buf[100:104] = b"wxyz"
    lease = registry.acquire(ShmRef("r", 4, 100))
    out = registry.acquire(ShmRef("r", 8, 4096))
    try:
        assert not lease.sealed and bytes(lease.read()) == b"wxyz"
        data = lease.read()
        segment.buf[100:104] = b"1234"
        assert bytes(data) == b"wxyz" and bytes(lease.view) == b"1234"  # a copy, re-read on each access
        out.view[0:4] = b"ABCD"  # a view's slice assignment writes through
        out.write(b"EF")
        assert bytes(segment.buf[4096:4100]) == b"EFCD"
        os.ftruncate(segment._fd, 64)  # the client truncates with the leases held (never touch .buf now)
        for call in (lease.read, lambda: out.write(b"x"), lambda: out.view):
            with pytest.raises(InferenceError) as info:
                call()
            assert info.value.status is Status.INVALID_ARG and "'r'" in info.value.message
            assert "truncated" in info.value.message
        assert os.fstat(segment._fd).st_size == 64  # never grown back by a write
    finally:
        lease.release()
        out.release()
        registry.close()
