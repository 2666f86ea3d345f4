"""The ZeroMQ frontend's hot-path shortcuts give the same answers as the general code: the reused
reply headers, the cached ring layouts and the one-test header decode."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from fake_plane import FakeRepository, fake_plane
from zmq_harness import NO_DIR
from zmq_rings import ring_request

from edgeserve.client.ring import FrameRing
from edgeserve.config import Settings
from edgeserve.frontends.peer import zmq_peer
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.shm.ring import HEADER, MAGIC
from edgeserve.frontends.zmq import codec, replies, wire
from edgeserve.frontends.zmq.server import ZmqFrontend
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InferResponse, OutputTensor


def general_reply(req_id: object, response: InferResponse) -> list[bytes]:
    """What the field-by-field path (the only path before the shortcut) sends."""
    outputs = [
        {"name": o.name, "datatype": o.datatype, "shape": [int(d) for d in o.shape]} for o in response.outputs
    ]
    header = replies.infer_header(req_id, response, outputs)
    assert all(o.data is not None for o in response.outputs)
    return [header, *(bytes(datatypes.to_wire_bytes(o.data, o.datatype)) for o in response.outputs)]  # type: ignore[arg-type]


def reply(req_id: object, response: InferResponse) -> list[bytes]:
    decoded = codec.Decoded(req_id, InferRequest("m"))
    return [bytes(memoryview(frame).cast("B")) for frame in replies.infer_reply(decoded, response)]


def response(*outputs: OutputTensor, **params: object) -> InferResponse:
    res = InferResponse("model_a", "3", "", list(outputs))
    res.parameters.update(params)  # type: ignore[arg-type]
    return res


def test_plain_replies_are_byte_identical_to_the_general_path() -> None:
    probs = np.arange(8, dtype=np.float32).reshape(2, 4)
    labels = np.array([[1, 2]], dtype=np.int64)
    plain = response(
        OutputTensor("probs", "FP32", probs.shape, probs), OutputTensor("ids", "INT64", (1, 2), labels)
    )
    for req_id in (17, 18, 0, -5, 2**63 - 1, 2**64 - 1):  # the second id reuses the cached header
        assert reply(req_id, plain) == general_reply(req_id, plain)
        assert json.loads(reply(req_id, plain)[0])["id"] == req_id
    # a new shape of the same output is a new header, not the cached one
    wider = np.zeros((2, 5), dtype=np.float32)
    other = response(OutputTensor("probs", "FP32", wider.shape, wider))
    assert json.loads(reply(19, other)[0])["outputs"][0]["shape"] == [2, 5]
    assert reply(19, other) == general_reply(19, other)


@pytest.mark.parametrize(
    "req_id",
    ["a-string-id", 2**64, None, 1.5, True],  # not written as plain digits by every encoder
)
def test_other_ids_are_echoed_as_before(req_id: object) -> None:
    out = np.ones((1, 3), dtype=np.float32)
    res = response(OutputTensor("o", "FP32", out.shape, out))
    assert reply(req_id, res) == general_reply(req_id, res)
    assert json.loads(reply(req_id, res)[0])["id"] == req_id


def test_outputs_that_need_the_general_path() -> None:
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous: gathered
    res = response(OutputTensor("o", "FP32", strided.shape, strided))
    assert reply(5, res) == general_reply(5, res)
    assert np.frombuffer(reply(5, res)[1], np.float32).tolist() == strided.ravel().tolist()
    text = np.array([b"ab", b"c"], dtype=np.object_)
    res = response(OutputTensor("t", "BYTES", (2,), text))
    assert reply(6, res) == general_reply(6, res)
    bf16 = np.zeros((2,), dtype=datatypes.BF16_DTYPE)
    res = response(OutputTensor("b", "BF16", (2,), bf16))
    assert reply(7, res) == general_reply(7, res)
    out = np.ones((1,), dtype=np.float32)
    with_params = response(OutputTensor("o", "FP32", (1,), out), sequence_end=True)
    assert json.loads(reply(8, with_params)[0])["parameters"] == {"sequence_end": True}
    assert reply(8, with_params) == general_reply(8, with_params)


@pytest.fixture
def registry() -> Iterator[SharedMemoryRegistry]:
    reg = SharedMemoryRegistry()
    yield reg
    reg.close()


def test_a_rewritten_ring_header_is_read_again(registry: SharedMemoryRegistry) -> None:
    """Layouts are cached by the header's bytes: a producer that rewrites its header (a corrupt one
    here) gets the error for what is there now, not the layout cached for the old bytes."""
    with FrameRing(2, 64) as ring:
        registry.register(ring.name, ring.key, 0, ring.byte_size)  # an in-process caller
        slot = ring.acquire()
        slot.ndarray((1, 4), np.float32)[:] = [[1, 2, 3, 4]]
        decoded = codec.decode_infer(ring_request(ring, slot.index, slot.gen), [], registry)
        assert read_in_place(decoded) == [[1, 2, 3, 4]]
        decoded.release()
        layout = ring.layout
        ring.buf[: HEADER.size] = HEADER.pack(MAGIC, 1, 2, 64, layout.data_offset, 64, 1)  # bad total
        with pytest.raises(InferenceError) as info:
            codec.decode_infer(ring_request(ring, slot.index, slot.gen), [], registry)
        assert info.value.status == Status.INVALID_ARG and "corrupt header" in info.value.message
        ring.buf[: HEADER.size] = layout.header_bytes()
        codec.decode_infer(ring_request(ring, slot.index, slot.gen), [], registry).release()


def test_two_rings_with_different_layouts(registry: SharedMemoryRegistry) -> None:
    with FrameRing(2, 64) as small, FrameRing(3, 4096) as large:
        for ring in (small, large):
            registry.register(ring.name, ring.key, 0, ring.byte_size)  # an in-process caller
        for i, ring in enumerate((small, large, small, large)):
            slot = ring.acquire()
            slot.ndarray((1, 4), np.float32)[:] = i
            decoded = codec.decode_infer(ring_request(ring, slot.index, slot.gen), [], registry)
            assert read_in_place(decoded) == [[i] * 4]
            decoded.release()
            slot.release()


def read_in_place(decoded: codec.Decoded) -> list[list[float]]:
    """A mapped ring's input: a view of its slot, held by the slot's guard (no lease of the data
    plane's), let go with the request."""
    tensor = decoded.request.inputs[0]
    assert tensor.shm is None and tensor.data is not None and decoded.in_slots == [tensor]
    values: list[list[float]] = tensor.data.tolist()
    return values


def test_header_fields_outside_the_common_case(registry: SharedMemoryRegistry) -> None:
    """A numeric version, a missing parameters object and the sequence shorthands still decode."""
    base = {"v": 1, "model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}]}
    frames = [np.zeros(2, np.float32).tobytes()]
    decoded = codec.decode_infer({**base, "version": 3}, frames, registry)
    assert decoded.request.model_version == "3" and decoded.request.parameters == {}
    decoded = codec.decode_infer({**base, "sequence_id": 9, "sequence_start": True}, frames, registry)
    assert decoded.request.parameters == {"sequence_id": 9, "sequence_start": True}
    decoded = codec.decode_infer({**base, "priority": 2, "timeout_us": 5}, frames, registry)
    assert (decoded.request.priority, decoded.request.timeout_us) == (2, 5)
    for bad, text in (
        ({"priority": True}, "'priority' must be int"),
        ({"version": 1.5}, "'version' must be"),
    ):
        with pytest.raises(InferenceError) as info:
            codec.decode_infer({**base, **bad}, frames, registry)
        assert text in info.value.message
    with pytest.raises(InferenceError, match="'region' must be str"):
        ref = {"region": 5, "byte_size": 8}
        codec.decode_infer(
            {**base, "inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "shm": ref}]}, [], registry
        )


def test_send_copy_threshold() -> None:
    assert wire.send_copy(b"x" * (wire.ZERO_COPY_MIN - 1))
    assert not wire.send_copy(b"x" * wire.ZERO_COPY_MIN)
    assert wire.send_copy(np.zeros(10, np.float32))
    assert not wire.send_copy(np.zeros(wire.ZERO_COPY_MIN, np.uint8))
    assert not wire.send_copy(memoryview(bytearray(wire.ZERO_COPY_MIN)))
    with mmap.mmap(-1, wire.ZERO_COPY_MIN) as mapping:
        assert not wire.send_copy(memoryview(mapping))


class _Frame:
    """A received frame as far as the peer lookup reads it: libzmq's Peer-Address property."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def get(self, name: str) -> str:
        if name != "Peer-Address" or self.address is None:
            raise zmq.ZMQError(22)
        return self.address


def test_peer_identities_are_read_per_message_and_memoised_by_address() -> None:
    """The identity behind a routing id is read from every message (a reused id lends nothing): the
    memo is keyed by the address libzmq reports for that message, never by the socket."""
    frontend = ZmqFrontend(fake_plane(FakeRepository(NO_DIR, [])), Settings())
    frontend._peer_credentials = True
    alice, bob = "localhost:1000:1000:41", "localhost:1001:1001:42"
    first = frontend._peer_of(_Frame(alice))
    assert first == zmq_peer(_Frame(alice), True) and first.uid == 1000
    assert frontend._peer_of(_Frame(alice)) is first  # memoised
    assert frontend._peer_of(_Frame(bob)).uid == 1001  # same socket, another user: read again
    assert frontend._peer_of(_Frame("10.0.0.7:5555")).transport == "zmq-tcp"
    assert frontend._peer_of(_Frame(None)) == zmq_peer(_Frame(None), True)  # no metadata
    for n in range(2000):  # bounded
        frontend._peer_of(_Frame(f"localhost:{n}:{n}:1"))
    assert len(frontend._identities) <= 1024
