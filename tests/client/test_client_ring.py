"""Producer-side frame ring and client basics (no server needed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeserve.client import AsyncZmqClient, ClientError, FrameRing, RingFull, ZmqClient
from edgeserve.frontends.shm.ring import GEN


def test_slots_cycle_with_new_generations() -> None:
    with FrameRing(2, 100, sealed=False) as ring:  # the /dev/shm variant (sealed memfd: tests/frontends/shm)
        assert os.path.exists(f"/dev/shm/{ring.key}")
        a, b = ring.acquire(), ring.acquire()
        assert (a.index, a.gen, b.index, b.gen) == (0, 1, 1, 1)
        assert ring.try_acquire() is None
        with pytest.raises(RingFull) as info:
            ring.acquire()
        assert info.value.status == "RESOURCE_EXHAUSTED" and "drop this frame" in info.value.message
        a.release()
        a.release()  # idempotent
        again = ring.acquire()
        assert again.index == 0 and again.gen == 2
        assert ring.generation(0) == 2
        assert GEN.unpack_from(ring.buf, ring.layout.generation_offset(0))[0] == 2
        a.release()  # a stale handle (older generation) does not free the slot twice
        assert ring.free == 0
        again.release()
        b.release()
        assert ring.free == 2
    assert not os.path.exists(f"/dev/shm/{ring.key}")


def test_quarantined_slots_are_reused_last() -> None:
    with FrameRing(3, 64) as ring:
        s0, s1 = ring.acquire(), ring.acquire()
        ring.quarantine(s0)  # its request timed out
        s1.release()
        order = [ring.acquire().index for _ in range(3)]
        assert order == [1, 2, 0]  # the slot released last first (its memory is warm), the stale one last


def test_the_slot_released_last_is_taken_first() -> None:
    """A producer sending one frame at a time writes into the same slot every time (its pages stay in
    cache); with more in flight, the most recently freed slot goes first."""
    with FrameRing(4, 64) as ring:
        first = ring.acquire()
        first.release()
        assert [ring.acquire().index for _ in range(1)] == [first.index]
        slots = [ring.acquire() for _ in range(3)]
        slots[1].release()
        slots[0].release()
        assert ring.acquire().index == slots[0].index
        assert ring.acquire().index == slots[1].index


def test_the_late_answer_of_a_timed_out_call_gives_its_slot_back() -> None:
    """A call that gave up quarantines its slots; its answer arriving later releases them: every slot
    must be free again, not lost to both lists (a camera producer ran out of slots this way)."""
    with FrameRing(4, 64) as ring:
        slots = [ring.acquire() for _ in range(4)]
        for slot in slots:
            ring.quarantine(slot)
        for slot in slots:
            slot.release()  # the late answers
        assert ring.free == 4
        taken = [ring.acquire() for _ in range(4)]
        assert ring.try_acquire() is None and sorted(s.index for s in taken) == [0, 1, 2, 3]


def test_a_late_release_does_not_touch_the_slot_of_a_newer_call() -> None:
    with FrameRing(1, 64) as ring:
        old = ring.acquire()
        ring.quarantine(old)
        new = ring.acquire()  # reuses the quarantined slot with a new generation
        ring.quarantine(new)
        old.release()  # the first call's late answer: must not free the newer call's slot
        new.release()
        assert ring.free == 1 and ring.acquire().gen == 3


def test_write_read_and_views() -> None:
    with FrameRing(2, 64) as ring:
        slot = ring.acquire()
        ref = slot.write(np.arange(4, dtype=np.float32).reshape(2, 2))
        assert (ref.region, ref.byte_size, ref.datatype, ref.shape, ref.slot) == (
            ring.name,
            16,
            "FP32",
            (2, 2),
            slot,
        )
        assert ring.read(slot, "FP32", (2, 2), 16).tolist() == [[0, 1], [2, 3]]
        view = slot.ndarray((4,), np.int32)
        view[:] = 7
        assert slot.tensor((4,), "INT32").byte_size == 16
        assert ring.read(slot, "INT32", (4,), 16).tolist() == [7] * 4
        texts = np.array([b"ab", b"cde"], dtype=object)
        ref = slot.write(texts)
        assert ref.datatype == "BYTES" and ref.byte_size == 4 + 2 + 4 + 3
        assert ring.read(slot, "BYTES", (2,), ref.byte_size).tolist() == [b"ab", b"cde"]
        with pytest.raises(ClientError, match="does not fit"):
            slot.write(np.zeros(100, np.float32))
        with pytest.raises(ValueError, match="slots hold 64"):
            slot.ndarray((100,), np.float32)
        del view


def test_write_gathers_a_strided_view_in_one_copy() -> None:
    # a crop of a camera frame is not contiguous: write() gathers it straight into the slot
    frame = np.arange(8 * 10 * 3, dtype=np.uint8).reshape(8, 10, 3)
    crop = frame[1:7:2, 2:8, ::-1]
    assert not crop.flags.c_contiguous
    with FrameRing(2, 256) as ring:
        slot = ring.acquire()
        ref = slot.write(crop)
        assert (ref.datatype, ref.shape, ref.byte_size) == ("UINT8", (3, 6, 3), crop.nbytes)
        assert np.array_equal(ring.read(slot, "UINT8", (3, 6, 3), crop.nbytes), crop)
        half = np.linspace(-2, 2, 6, dtype=np.float16).reshape(2, 3).T
        ref = slot.write(half)
        assert np.array_equal(ring.read(slot, "FP16", (3, 2), 12), half)


def test_writes_reuse_a_view_per_slot_and_closing_unmaps() -> None:
    """Slot.write keeps one typed view per (slot, dtype, shape): each write lands in its own slot, a
    new dtype or shape gets its own view, and close() drops them so the mapping really goes."""
    ring = FrameRing(2, 64)
    first, second = ring.acquire(), ring.acquire()
    first.write(np.full((2, 2), 1.5, np.float32))
    second.write(np.full((2, 2), -3.0, np.float32))
    first.write(np.full((2, 2), 2.5, np.float32))  # the cached view of slot `first`, new values
    assert ring.read(first, "FP32", (2, 2), 16).tolist() == [[2.5, 2.5], [2.5, 2.5]]
    assert ring.read(second, "FP32", (2, 2), 16).tolist() == [[-3.0, -3.0], [-3.0, -3.0]]
    ref = second.write(np.array([1, -2, 3], np.int8))
    assert (ref.datatype, ref.shape, ref.byte_size) == ("INT8", (3,), 3)
    assert ring.read(second, "INT8", (3,), 3).tolist() == [1, -2, 3]
    with pytest.raises(ClientError, match="does not fit a 64-byte slot"):
        first.write(np.zeros((5, 4), np.float32))
    mapping = ring._map
    ring.close()
    assert mapping is not None and mapping.closed  # no cached view kept it mapped
    with pytest.raises(ClientError) as info:
        first.write(np.full((2, 2), 1.0, np.float32))
    assert info.value.status == "UNAVAILABLE"


def test_closed_ring_refuses_slots() -> None:
    ring = FrameRing(1, 64)
    ring.close()
    ring.close()
    with pytest.raises(ClientError) as info:
        ring.try_acquire()
    assert info.value.status == "UNAVAILABLE"


def test_client_imports_without_runtimes() -> None:
    code = (
        "import sys\n"
        "for name in ('onnxruntime', 'openvino', 'tensorrt', 'grpc', 'aiohttp'):\n"
        "    sys.modules[name] = None\n"
        "import edgeserve.client as c\n"
        "assert c.ZmqClient and c.AsyncZmqClient and c.FrameRing\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_client_error_repr() -> None:
    error = ClientError("NOT_FOUND", "no model")
    assert str(error) == "NOT_FOUND: no model" and error.status == "NOT_FOUND"
    assert repr(error) == "ClientError('NOT_FOUND', 'no model')"


class _RefusingSealed:
    """A server that refuses to register rings with `status` (sealed ones only, or every one)."""

    def __init__(self, status: str, every: bool) -> None:
        self.status, self.every, self.offered = status, every, []

    def register(self, ring: FrameRing) -> FrameRing:
        self.offered.append(ring)
        if ring.sealed or self.every:
            raise ClientError(self.status, f"region '{ring.name}' refused")
        return ring


@pytest.mark.parametrize(
    ("status", "every", "falls_back"),
    [("PERMISSION_DENIED", False, True), ("NOT_FOUND", True, False), ("UNAVAILABLE", False, False)],
)
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_create_ring_falls_back_to_dev_shm_only_where_a_sealed_ring_is_refused(
    tmp_path: Path, status: str, every: bool, falls_back: bool, flavour: str
) -> None:
    server = _RefusingSealed(status, every)
    endpoint = f"ipc://{tmp_path}/none.zmq"  # nothing listens: only register_ring answers
    if flavour == "sync":
        client = ZmqClient(endpoint, timeout=0.2)
        client.register_ring = server.register  # type: ignore[method-assign]

        def create() -> FrameRing:
            return client.create_ring(2, 64)

        close = client.close
    else:
        aclient = AsyncZmqClient(endpoint, timeout=0.2)

        async def register(ring: FrameRing) -> FrameRing:
            return server.register(ring)

        aclient.register_ring = register  # type: ignore[method-assign]

        def create() -> FrameRing:
            return asyncio.run(aclient.create_ring(2, 64))

        def close() -> None:
            asyncio.run(aclient.close())

    try:
        if falls_back:
            ring = create()
            assert not ring.sealed and not ring.closed
            assert [r.sealed for r in server.offered] == [True, False]
        else:
            with pytest.raises(ClientError) as info:
                create()
            assert info.value.status == status
        first = server.offered[0]
        assert first.sealed and first.closed  # the refused ring is closed (unlinked) at once
        assert all(r.closed for r in server.offered[: 1 if falls_back else None])
    finally:
        close()
    assert all(r.closed for r in server.offered)  # what was registered goes with the client
