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
