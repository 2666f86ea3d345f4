"""ZmqFrontend + DataPlane + shm registry + client, over real sockets and real shared memory:
round trips, errors, slot reuse, backpressure. Models are numpy functions behind a thread-pool
scheduler (zmq_harness); the real runtime path is covered by test_zmq_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest
import zmq
from zmq_harness import DATATYPES, RunningFrontend, assert_same, gate, sample, ungate

from edgeserve.client import AsyncZmqClient, ClientError, ShmTensor, ZmqClient
from edgeserve.frontends.zmq import wire


# -- round trips -------------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", DATATYPES)
def test_round_trip_every_datatype_inline_ring_and_region(client: ZmqClient, datatype: str) -> None:
    data = sample(datatype)
    model = f"id_{datatype.lower()}"
    result = client.infer(model, {"INPUT0": data})
    assert_same(result.as_numpy("OUTPUT0"), data)
    assert result.model_name == model and result.model_version == "1"

    ring = client.create_ring(slots=2, slot_size=4096)
    result = client.infer(model, {"INPUT0": data}, {"OUTPUT0": ring}, ring=ring)
    assert_same(result.as_numpy("OUTPUT0"), data)
    assert ring.free == 2  # both slots came back

    # a plain (Triton-style) region owned by this client: input at offset 0, output at 2048
    key = f"es-test-{uuid.uuid4().hex[:8]}"
    segment = shared_memory.SharedMemory(name=key, create=True, size=4096)
    try:
        client.register_region(key, key, 4096)
        slot = ring.acquire()
        ref = slot.write(data)  # serialise (BYTES too) through a slot, then copy into the region
        segment.buf[: ref.byte_size] = slot.buffer[: ref.byte_size]
        slot.release()
        result = client.infer(
            model,
            {"INPUT0": ShmTensor(key, ref.byte_size, 0, ref.datatype, ref.shape)},
            {"OUTPUT0": ShmTensor(key, 2048, 2048)},
        )
        desc = result.shm_outputs["OUTPUT0"]
        assert desc["datatype"] == datatype and desc["shape"] == list(data.shape)
        assert bytes(segment.buf[2048 : 2048 + ref.byte_size]) == bytes(segment.buf[: ref.byte_size])
        with pytest.raises(KeyError, match="shared memory region"):
            result.as_numpy("OUTPUT0")
        client.unregister_region(key)
    finally:
        segment.close()
        segment.unlink()


def test_zero_copy_inline_frames_and_large_ring_frames(server: RunningFrontend) -> None:
    frame = np.random.default_rng(1).integers(0, 255, (1, 480, 640, 3), dtype=np.uint8)
    with ZmqClient(server.endpoint, timeout=5.0, copy_inputs=False) as client:
        want = frame.reshape(1, -1).mean(1, keepdims=True).astype(np.float32)
        assert_same(client.infer("mean", {"IMAGE": frame}).as_numpy("MEAN"), want)
        ring = client.create_ring(slots=4, slot_size=frame.nbytes)
        slot = ring.acquire()
        slot.ndarray(frame.shape, np.uint8)[:] = frame  # the producer writes the slot in place
        result = client.infer("mean", {"IMAGE": slot.tensor(frame.shape, np.uint8)})
        assert_same(result.as_numpy("MEAN"), want)
        assert ring.free == 4
        # A reply frame of >= 64 KB leaves the server without a copy; below that it is copied.
        for size in (1000, 70_000, 921_600):
            data = np.random.default_rng(size).integers(0, 255, (1, size), dtype=np.uint8)
            assert_same(client.infer("id_uint8", {"INPUT0": data}).as_numpy("OUTPUT0"), data)


def test_pipelined_requests_complete_and_match(client: ZmqClient) -> None:
    ring = client.create_ring(slots=16, slot_size=256)
    futures = {}
    for i in range(200):
        data = np.full((1, 8), i, dtype=np.int32)
        if i % 2:
            inputs: dict[str, Any] = {"INPUT0": client.acquire_slot(ring).write(data)}
        else:
            inputs = {"INPUT0": data}
        futures[client.submit("id_int32", inputs)] = i
    seen = set()
    for future in client.as_completed(list(futures), timeout=10):
        i = futures[future]
        assert future.result().as_numpy("OUTPUT0").tolist() == [[i] * 8]
        seen.add(i)
    assert seen == set(range(200))
    assert ring.free == 16 and client.in_flight == 0


def test_async_client_round_trip_and_pipelining(server: RunningFrontend) -> None:
    async def main() -> None:
        async with AsyncZmqClient(server.endpoint, timeout=5.0) as client:
            assert (await client.ping())["wire"] == wire.VERSION
            ring = await client.create_ring(slots=8, slot_size=1024)
            data = sample("FP32", (1, 16))
            result = await client.infer("id_fp32", {"INPUT0": data}, {"OUTPUT0": ring}, ring=ring)
            assert_same(result.as_numpy("OUTPUT0"), data)
            futures = [
                await client.submit("id_int64", {"INPUT0": np.full((1, 3), i, np.int64)}) for i in range(50)
            ]
            results = await asyncio.gather(*futures)
            assert [r.as_numpy("OUTPUT0")[0, 0] for r in results] == list(range(50))
            with pytest.raises(ClientError) as info:
                await client.infer("missing", {"INPUT0": data})
            assert info.value.status == "NOT_FOUND"
            assert ring.free == 8

    asyncio.run(main())


def test_async_clients_sharing_a_loop_lose_no_reply(server: RunningFrontend) -> None:
    """Eight clients on one event loop, four requests in flight each, interleaved with ring inputs:
    replies arrive while other sockets send (ZMQ_FD is edge-triggered); every one comes back, to its
    own request."""

    async def one_client(k: int) -> None:
        async with AsyncZmqClient(server.endpoint, timeout=10.0) as client:
            ring = await client.create_ring(slots=4, slot_size=64)
            for start in range(0, 200, 4):
                futures = []
                for i in range(start, start + 4):
                    value = np.full((1, 3), k * 1000 + i, np.int64)
                    if i % 2:
                        futures.append(await client.submit("id_int64", {"INPUT0": value}))
                    else:
                        slot = ring.acquire()
                        futures.append(await client.submit("id_int64", {"INPUT0": slot.write(value)}))
                results = await asyncio.gather(*futures)
                got = [int(r.as_numpy("OUTPUT0")[0, 0]) for r in results]
                assert got == [k * 1000 + i for i in range(start, start + 4)]
            assert ring.free == 4

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(one_client(k) for k in range(8))), 120)

    asyncio.run(main())


def test_async_client_without_a_server_is_unavailable_after_its_timeout(tmp_path: Any) -> None:
    async def main() -> None:
        client = AsyncZmqClient(f"ipc://{tmp_path}/nobody.zmq", timeout=0.3)
        try:  # answered (bounded by its timeout); a hang would end at the test timeout
            with pytest.raises(ClientError) as info:
                await client.infer("m", {"INPUT0": np.ones((1, 4), np.float32)})
        finally:
            await client.close()
        assert info.value.status == "UNAVAILABLE" and "cannot reach edgeserve" in info.value.message

    asyncio.run(main())


def test_async_client_created_before_the_server_binds_gets_its_answer(server: RunningFrontend) -> None:
    """IMMEDIATE: nothing is queued before the connection is up; the send is retried until it is."""
    endpoint = f"ipc:///tmp/edgeserve-late-{uuid.uuid4().hex[:8]}.zmq"

    async def main() -> None:
        async with AsyncZmqClient(endpoint, timeout=10.0) as client:
            request = asyncio.ensure_future(
                client.infer("id_int64", {"INPUT0": np.full((1, 3), 7, np.int64)})
            )
            await asyncio.sleep(0.3)
            assert not request.done()
            relay = zmq.Context.instance().socket(zmq.ROUTER)
            relay.bind(endpoint)  # a one-message relay to the real server
            backend = zmq.Context.instance().socket(zmq.DEALER)
            backend.connect(server.endpoint)
            try:
                deadline = time.monotonic() + 10
                while not relay.poll(10):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                ident, *frames = relay.recv_multipart()
                backend.send_multipart(frames)
                while not backend.poll(10):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                relay.send_multipart([ident, *backend.recv_multipart()])
                result = await asyncio.wait_for(request, 10)
                assert int(result.as_numpy("OUTPUT0")[0, 0]) == 7
            finally:
                relay.close(linger=0)
                backend.close(linger=0)

    asyncio.run(main())


def uint8_request(size: int, **fields: Any) -> dict[str, Any]:
    """The header of a raw infer request to id_uint8 with one [1, size] input (sent in the next frame)."""
    inputs = [{"name": "INPUT0", "datatype": "UINT8", "shape": [1, size]}]
    return {"v": 1, "op": "infer", "model": "id_uint8", "inputs": inputs, **fields}


def test_req_socket_works_one_at_a_time(server: RunningFrontend) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart([wire.dumps(uint8_request(3, id="r1")), bytes([1, 2, 3])])
        assert sock.poll(5000)
        reply_header, payload = sock.recv_multipart()
        reply = wire.loads(reply_header)
        assert reply["status"] == "OK" and reply["id"] == "r1"
        assert reply["outputs"] == [{"name": "OUTPUT0", "datatype": "UINT8", "shape": [1, 3]}]
        assert payload == bytes([1, 2, 3])
    finally:
        sock.close(linger=0)


# -- errors ------------------------------------------------------------------------------------------
def raw_call(server: RunningFrontend, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.endpoint)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply"
        reply = sock.recv_multipart()
        return wire.loads(reply[0]), reply[1:]
    finally:
        sock.close(linger=0)


def test_malformed_messages_get_clear_errors(server: RunningFrontend) -> None:
    reply, _ = raw_call(server, [b"not json"])
    assert reply["status"] == "INVALID_ARG" and "not valid JSON" in reply["message"]
    reply, _ = raw_call(server, [b"[1, 2]"])
    assert reply["status"] == "INVALID_ARG" and "JSON object" in reply["message"]
    reply, _ = raw_call(server, [wire.dumps({"v": 2, "id": 7, "op": "infer"})])
    assert reply["status"] == "UNSUPPORTED" and reply["id"] == 7 and "version 2" in reply["message"]
    reply, _ = raw_call(server, [wire.dumps({"v": 1, "id": 8, "op": "dance"})])
    assert reply["status"] == "INVALID_ARG" and "unknown op 'dance'" in reply["message"]
    reply, _ = raw_call(server, [wire.dumps({"v": 1, "id": 9, "op": "infer", "model": "id_fp32"})])
    assert reply["status"] == "INVALID_ARG" and "missing field 'inputs'" in reply["message"]
    base = {"v": 1, "id": 10, "op": "infer", "model": "id_fp32"}
    one = [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2]}]
    reply, _ = raw_call(server, [wire.dumps({**base, "inputs": one})])
    assert reply["status"] == "INVALID_ARG" and "no tensor frame follows" in reply["message"]
    reply, _ = raw_call(server, [wire.dumps({**base, "inputs": one}), b"\0" * 8, b"extra"])
    assert reply["status"] == "INVALID_ARG" and "2 tensor frame(s)" in reply["message"]
    reply, _ = raw_call(server, [wire.dumps({**base, "inputs": one}), b"\0" * 7])
    assert (
        reply["status"] == "INVALID_ARG"
        and "got 7 bytes" in reply["message"]
        and "expected 8" in reply["message"]
    )
    bad_shape = [{"name": "INPUT0", "datatype": "FP32", "shape": [1, -2]}]
    reply, _ = raw_call(server, [wire.dumps({**base, "inputs": bad_shape}), b""])
    assert reply["status"] == "INVALID_ARG" and "non-negative" in reply["message"]


def test_data_plane_errors_are_the_same_as_other_frontends(client: ZmqClient) -> None:
    with pytest.raises(ClientError) as info:
        client.infer("no_such_model", {"INPUT0": np.zeros((1, 2), np.float32)})
    assert info.value.status == "NOT_FOUND" and "no_such_model" in info.value.message
    with pytest.raises(ClientError) as info:
        client.infer("id_fp32", {"INPUT0": np.zeros((1, 2), np.float64)})
    assert info.value.status == "INVALID_ARG" and "data-type is 'FP64'" in info.value.message
    with pytest.raises(ClientError) as info:
        client.infer("id_fp32", {"INPUT0": np.zeros((1, 2), np.float32)}, ["NOPE"])
    assert info.value.status == "INVALID_ARG" and "unexpected inference output 'NOPE'" in info.value.message


def test_bad_references_give_clear_errors(client: ZmqClient) -> None:
    ring = client.create_ring(slots=2, slot_size=64)
    fp32 = {"datatype": "FP32", "shape": (1, 4)}

    def fails(ref: ShmTensor, status: str, text: str) -> None:
        with pytest.raises(ClientError) as info:
            client.infer("id_fp32", {"INPUT0": ref})
        assert info.value.status == status, info.value
        assert text in info.value.message, info.value.message

    fails(
        ShmTensor("no-such-region", 16, 0, **fp32),
        "NOT_FOUND",
        "Unable to find shared memory region: 'no-such-region'",
    )
    fails(ShmTensor(ring.name, 16, ring.byte_size + 8, **fp32), "INVALID_ARG", "Invalid offset")
    fails(ShmTensor(ring.name, ring.byte_size, 8, **fp32), "INVALID_ARG", "Invalid offset + byte size")
    fails(
        ShmTensor(ring.name, 12, 0, **fp32),
        "INVALID_ARG",
        "got 12 bytes for shape [1, 4] of FP32, expected 16",
    )
    slot = ring.acquire()
    fails(
        ShmTensor(ring.name, 16, 60, slot=slot, **fp32), "INVALID_ARG", "past the end of the slot (64 bytes)"
    )
    fails(slot.tensor((1, 4), np.float32, byte_size=20), "INVALID_ARG", "expected 16")
    slot = ring.acquire()
    forged = type(slot)(ring, 5, 1)  # slot index past the ring
    fails(ShmTensor(ring.name, 16, 0, slot=forged, **fp32), "INVALID_ARG", "slot 5 is out of range for ring")
    # slot references into a region that is not a ring
    key = f"es-test-{uuid.uuid4().hex[:8]}"
    segment = shared_memory.SharedMemory(name=key, create=True, size=4096)
    try:
        client.register_region(key, key, 4096)
        fails(ShmTensor(key, 16, 0, slot=slot, **fp32), "INVALID_ARG", "is not an edgeserve frame ring")
    finally:
        segment.close()
        segment.unlink()
    # output reference too small for the result
    with pytest.raises(ClientError) as info:
        client.infer("id_fp32", {"INPUT0": np.zeros((1, 32), np.float32)}, {"OUTPUT0": ring})
    assert info.value.status == "INVALID_ARG" and "should be at least 128 bytes" in info.value.message
    assert ring.free == 2


def test_stale_slot_reference_is_refused_before_reading(client: ZmqClient) -> None:
    ring = client.create_ring(slots=1, slot_size=64)
    slot = ring.acquire()
    ref = slot.write(np.ones((1, 4), np.float32))
    ring.release(slot)
    reused = ring.acquire()  # same slot, next generation
    assert reused.index == slot.index and reused.gen == slot.gen + 1
    with pytest.raises(ClientError) as info:
        client.infer("id_fp32", {"INPUT0": ref})
    assert info.value.status == "INVALID_ARG"
    assert f"slot 0 of ring '{ring.name}' was reused before the request was read" in info.value.message
    assert f"generation is {reused.gen}, the request carries {slot.gen}" in info.value.message


def test_slot_reused_while_in_flight_is_detected(server: RunningFrontend, client: ZmqClient) -> None:
    ring = client.create_ring(slots=2, slot_size=64)
    event = gate(server, "gated")
    try:
        slot = ring.acquire()
        future = client.submit("gated", {"INPUT0": slot.write(np.ones((1, 4), np.float32))})
        client.poll(0.05)
        # The producer wrongly reuses the slot while the request is queued: a new generation.
        ring._gens[slot.index] += 1
        slot.buffer[:16] = np.zeros(4, np.float32).tobytes()
    finally:
        ungate(server, "gated", event)
    with pytest.raises(ClientError) as info:
        future.result()
    assert info.value.status == "INVALID_ARG"
    assert "was reused while the request was in flight" in info.value.message
    assert "the result was discarded" in info.value.message


def test_output_slot_reused_is_never_written(server: RunningFrontend, client: ZmqClient) -> None:
    ring = client.create_ring(slots=2, slot_size=64)
    event = gate(server, "gated")
    try:
        out = ring.acquire()
        future = client.submit("gated", {"INPUT0": np.full((1, 4), 7, np.float32)}, {"OUTPUT0": out})
        client.poll(0.05)
        ring._gens[out.index] += 1  # reused by the producer for something else
        out.buffer[:16] = b"\xab" * 16
    finally:
        ungate(server, "gated", event)
    with pytest.raises(ClientError) as info:
        future.result()
    assert "was reused before the output was written" in info.value.message
    assert "the output was not written" in info.value.message
    assert bytes(out.buffer[:16]) == b"\xab" * 16


def test_timeout_is_a_clear_error_and_the_slot_is_quarantined(
    server: RunningFrontend, client: ZmqClient
) -> None:
    ring = client.create_ring(slots=2, slot_size=64)
    event = gate(server, "gated")
    try:
        with pytest.raises(ClientError) as info:  # the gate holds the request: only the timeout ends it
            client.infer("gated", {"INPUT0": np.ones((1, 4), np.float32)}, ring=ring, timeout=0.2)
        assert info.value.status == "DEADLINE_EXCEEDED"
        first = ring.acquire()
        second = ring.acquire()  # the quarantined slot comes last, with a new generation
        assert ring.try_acquire() is None
        assert second.gen == 2
        first.release()
        second.release()
    finally:
        ungate(server, "gated", event)
    # The late reply is drained and discarded on the next call.
    assert client.infer("id_fp32", {"INPUT0": np.ones((1, 4), np.float32)}).as_numpy("OUTPUT0").shape == (
        1,
        4,
    )


# -- backpressure ------------------------------------------------------------------------------------
def test_full_model_queue_is_reported_at_once(server: RunningFrontend, client: ZmqClient) -> None:
    event = gate(server, "tiny_queue")
    try:
        first = client.submit("tiny_queue", {"INPUT0": np.ones((1, 4), np.float32)})
        client.poll(0.05)
        second = client.submit("tiny_queue", {"INPUT0": np.ones((1, 4), np.float32)})
        with pytest.raises(ClientError) as info:
            second.result()
        assert info.value.status == "UNAVAILABLE" and "Exceeds maximum queue size" in info.value.message
        assert not first.done()  # told at once: the first request is still held at the gate
    finally:
        ungate(server, "tiny_queue", event)
    assert first.result().as_numpy("OUTPUT0").shape == (1, 4)


def test_in_flight_limit_per_client(server: RunningFrontend, client: ZmqClient) -> None:
    event = gate(server, "gated")
    try:
        futures = [client.submit("gated", {"INPUT0": np.ones((1, 1), np.float32)}) for _ in range(70)]
        # The refusals come back while the gate holds the rest: wait for them (generous for a busy box).
        deadline = time.monotonic() + 120
        while sum(f.done() for f in futures) < 70 - 64 and time.monotonic() < deadline:
            client.poll(0.2)
        refused = [f for f in futures if f.done()]
        assert len(refused) == 70 - 64
        for future in refused:
            assert isinstance(future.exception(), ClientError)
            assert future.exception().status == "RESOURCE_EXHAUSTED"  # type: ignore[union-attr]
            assert "max 64" in str(future.exception())
    finally:
        ungate(server, "gated", event)
    assert sum(1 for f in futures if f.exception() is None) == 64


def test_a_client_that_never_reads_does_not_block_others(server: RunningFrontend, client: ZmqClient) -> None:
    hog = zmq.Context.instance().socket(zmq.DEALER)
    hog.setsockopt(zmq.RCVHWM, 10)
    hog.connect(server.endpoint)
    try:
        payload = bytes(65536)
        for i in range(600):
            hog.send_multipart([wire.dumps(uint8_request(len(payload), id=i)), payload])
        for _ in range(20):  # each within the client's own timeout, while the hog never reads
            client.infer("id_uint8", {"INPUT0": np.ones((1, 4), np.uint8)})
    finally:
        hog.close(linger=0)
