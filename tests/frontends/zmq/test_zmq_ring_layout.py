"""The ring layout shared by producer and server, and the request decoder's field checks."""

from __future__ import annotations

import pytest

from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.shm.ring import GEN, HEADER, HEADER_SIZE, MAGIC, RingLayout
from edgeserve.frontends.zmq import codec, wire
from edgeserve.protocol.errors import InferenceError, Status


def test_plan_aligns_slots_and_data() -> None:
    layout = RingLayout.plan(3, 1000)
    assert layout.slot_size == 1024 and layout.data_offset == 4096
    assert layout.total_size == 4096 + 3 * 1024
    assert layout.generation_offset(2) == HEADER_SIZE + 2 * GEN.size
    big = RingLayout.plan(1000, 64)
    assert big.data_offset == 8192  # 64 + 8000 bytes of generations, page aligned
    with pytest.raises(ValueError):
        RingLayout.plan(0, 10)
    with pytest.raises(ValueError):
        RingLayout.plan(2, 0)


def test_parse_round_trip_and_corruption() -> None:
    layout = RingLayout.plan(4, 640)
    assert RingLayout.parse(layout.header_bytes(), "r", layout.total_size) == layout

    def bad(raw: bytes, text: str, size: int | None = None) -> None:
        with pytest.raises(InferenceError) as info:
            RingLayout.parse(raw, "r", size)
        assert info.value.status == Status.INVALID_ARG and text in info.value.message

    bad(b"\0" * 10, "too small")
    bad(b"X" * HEADER_SIZE, "not an edgeserve frame ring")
    bad(HEADER.pack(MAGIC, 9, 4, 640, 4096, 64, 4096 + 4 * 640), "layout version 9")
    bad(HEADER.pack(MAGIC, 1, 4, 640, 4096, 64, 1), "corrupt header")
    bad(HEADER.pack(MAGIC, 1, 4, 640, 64, 64, 64 + 4 * 640), "corrupt header")  # generations overlap data
    bad(layout.header_bytes(), "declares", layout.total_size - 1)


def test_locate_bounds() -> None:
    layout = RingLayout.plan(2, 128)
    assert layout.locate("r", 1, 8, 16) == 4096 + 128 + 8
    for slot, offset, size, text in [
        (2, 0, 1, "out of range"),
        (-1, 0, 1, "out of range"),
        (0, 120, 16, "past the end of the slot"),
        (0, -1, 1, "negative"),
    ]:
        with pytest.raises(InferenceError, match=text):
            layout.locate("r", slot, offset, size)


def test_decoder_names_the_bad_field() -> None:
    registry = SharedMemoryRegistry()
    cases = [
        ({"model": 3, "inputs": []}, "field 'model' must be str"),
        ({"model": "", "inputs": []}, "'model' must name a model"),
        ({"model": "m", "inputs": {}}, "field 'inputs' must be list"),
        ({"model": "m", "inputs": [1]}, "inputs[0] must be an object"),
        ({"model": "m", "inputs": [{"name": "a", "datatype": "FP32"}]}, "missing field 'shape'"),
        (
            {"model": "m", "inputs": [{"name": "a", "datatype": "FP32", "shape": [True]}]},
            "non-negative integers",
        ),
        ({"model": "m", "priority": "high", "inputs": []}, "field 'priority' must be int"),
        ({"model": "m", "parameters": {"x": [1]}, "inputs": []}, "parameter 'x' must be"),
        (
            {"model": "m", "inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "shm": 5}]},
            "'shm' must be an object",
        ),
        (
            {
                "model": "m",
                "inputs": [
                    {"name": "a", "datatype": "FP32", "shape": [1], "shm": {"region": "r", "byte_size": -4}}
                ],
            },
            "must not be negative",
        ),
        ({"model": "m", "inputs": [], "outputs": [{"name": 1}]}, "field 'name' must be str"),
        (
            {"model": "m", "inputs": [{"name": "a", "datatype": "FP99", "shape": [1]}]},
            "unknown datatype 'FP99'",
        ),
    ]
    for header, text in cases:
        frames = [b"\0\0\0\0"] if header["inputs"] and isinstance(header["inputs"], list) else []
        with pytest.raises(InferenceError) as info:
            codec.decode_infer(header, frames, registry)
        assert info.value.status == Status.INVALID_ARG, header
        assert text in info.value.message, (text, info.value.message)


def test_shm_ref_wire_form() -> None:
    assert wire.shm_ref("r", 16) == {"region": "r", "byte_size": 16}
    assert wire.shm_ref("r", 16, 8, slot=2, gen=5) == {
        "region": "r",
        "byte_size": 16,
        "offset": 8,
        "slot": 2,
        "gen": 5,
    }
    assert wire.loads(wire.dumps({"v": 1, "id": "é"})) == {"v": 1, "id": "é"}


def test_registry_owner_rule_used_by_the_zmq_frontend() -> None:
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(create=True, size=4096)
    registry = SharedMemoryRegistry()
    try:
        registry.register("a-ring", segment.name, 0, 4096, owner="zmq:aa")
        registry.register("triton", segment.name, 0, 4096)  # gRPC/HTTP: no owner
        registry.unregister("a-ring", owner="zmq:bb")  # another socket's: as an unknown name, kept
        assert registry.names(owner="zmq:aa") == ["a-ring"]
        with pytest.raises(InferenceError) as info:
            registry.unregister("triton", owner="zmq:bb")  # visible to the socket, not its own
        assert info.value.status == Status.PERMISSION_DENIED
        registry.unregister("unknown", owner="zmq:bb")  # unknown names stay fine
        assert registry.names(owner="zmq:aa") == ["a-ring"]
        registry.unregister("", owner="zmq:aa")  # a client's bye / disconnect
        assert registry.names() == ["triton"]
        registry.unregister("triton")  # the Triton API (no owner) may remove any region
        assert registry.names() == []
    finally:
        registry.close()
        segment.close()
        segment.unlink()
