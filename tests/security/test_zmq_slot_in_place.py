"""Hostile ring references on the ZeroMQ fast path: a mapped ring slot's input is read in place (a view
of the client's memory, no copy), so the reference must be held to the registered region and to its
shape exactly, and what is memoised per (datatype, shape) must stay bounded whatever a client sends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from zmq_rings import ring_request

from edgeserve.client.ring import FrameRing
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.zmq import codec
from edgeserve.protocol.errors import InferenceError, Status


@pytest.fixture
def registry() -> Iterator[SharedMemoryRegistry]:
    reg = SharedMemoryRegistry()
    yield reg
    reg.close()


def read_in_place(decoded: codec.Decoded) -> list[list[float]]:
    tensor = decoded.request.inputs[0]
    assert tensor.shm is None and tensor.data is not None and decoded.in_slots == [tensor]
    values: list[list[float]] = tensor.data.tolist()
    return values


def test_a_slot_past_the_end_of_its_region_is_refused(registry: SharedMemoryRegistry) -> None:
    """The layout comes from the client's header; the bytes read in place are checked against the
    size the region was registered with, as a lease of their own would be."""
    with FrameRing(2, 64) as ring:
        registry.register(ring.name, ring.key, 0, ring.byte_size - 64)  # the last slot is not in it
        first, last = ring.acquire(), ring.acquire()
        assert {first.index, last.index} == {0, 1}
        inside = first if first.index == 0 else last
        codec.decode_infer(ring_request(ring, inside.index, inside.gen), [], registry).release()
        outside = last if inside is first else first
        with pytest.raises(InferenceError) as info:
            codec.decode_infer(ring_request(ring, outside.index, outside.gen), [], registry)
        assert info.value.status == Status.INVALID_ARG and "Invalid offset + byte size" in info.value.message
        assert not registry._regions[ring.name]["in-process"].refs  # the guard's lease went back


def test_a_slot_read_in_place_must_hold_its_shape_exactly(registry: SharedMemoryRegistry) -> None:
    """The view of a slot is made from a memo of (datatype, shape) once one was read: a reference
    whose byte size does not match its shape is still refused, as the first time."""
    with FrameRing(2, 64) as ring:
        registry.register(ring.name, ring.key, 0, ring.byte_size)  # an in-process caller
        slot = ring.acquire()
        for byte_size in (16, 12, 16, 20):
            request = ring_request(ring, slot.index, slot.gen)
            request["inputs"][0]["shm"]["byte_size"] = byte_size  # type: ignore[index]
            if byte_size == 16:
                decoded = codec.decode_infer(request, [], registry)
                assert read_in_place(decoded) == [[0, 0, 0, 0]]
                decoded.release()
                continue
            with pytest.raises(InferenceError) as info:
                codec.decode_infer(request, [], registry)
            assert info.value.status == Status.INVALID_ARG
            assert f"got {byte_size} bytes for shape [1, 4] of FP32, expected 16" in info.value.message


def test_a_client_cycling_through_shapes_keeps_the_memo_bounded(registry: SharedMemoryRegistry) -> None:
    """Each new (datatype, shape) read in place is memoised: a client sending thousands of them must
    not grow the server's memory without bound."""
    with FrameRing(2, 4096) as ring:
        registry.register(ring.name, ring.key, 0, ring.byte_size)
        slot = ring.acquire()
        for n in range(1, 2 * codec._IN_PLACE_MAX + 2):
            request = ring_request(ring, slot.index, slot.gen)
            request["inputs"][0]["shape"] = [1, n % 1000 + 1]  # type: ignore[index]
            request["inputs"][0]["datatype"] = ("FP32", "INT32", "UINT8")[n % 3]  # type: ignore[index]
            size = (n % 1000 + 1) * (1 if n % 3 == 2 else 4)
            request["inputs"][0]["shm"]["byte_size"] = size  # type: ignore[index]
            codec.decode_infer(request, [], registry).release()
            assert len(codec._IN_PLACE) <= codec._IN_PLACE_MAX
