"""ZmqFrontend + DataPlane + shm registry + client, over real sockets and real shared memory.

Models are numpy functions behind a thread-pool scheduler (zmq_harness); the real runtime path is
covered by test_zmq_e2e.py.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from zmq_harness import RunningFrontend, identity_model, make_model, running_frontend

from edgeserve.client import AsyncZmqClient, ClientError, FrameRing, ShmTensor, ZmqClient
from edgeserve.frontends.zmq import wire
from edgeserve.protocol.datatypes import BF16_DTYPE

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]


def sample(datatype: str, shape: tuple[int, ...] = (2, 5), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if datatype == "BYTES":
        return np.array(
            [f"s{seed}-{i}".encode() * (i % 3 + 1) for i in range(int(np.prod(shape)))], dtype=object
        ).reshape(shape)
    if datatype == "BF16":
        assert BF16_DTYPE is not None
        return rng.standard_normal(shape).astype(np.float32).astype(BF16_DTYPE)
    dtype = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}.get(datatype)
    if dtype is not None:
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(np.dtype(datatype.lower()))
    return rng.integers(info.min, info.max, shape, dtype=np.dtype(datatype.lower()), endpoint=True)


@pytest.fixture(scope="module")
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="esz-", dir="/tmp"))  # short: unix socket paths are <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(sockdir: Path) -> Iterator[RunningFrontend]:
    models = [identity_model(f"id_{dt.lower()}", dt) for dt in DATATYPES]
    models.append(identity_model("gated", "FP32"))
    models.append(identity_model("tiny_queue", "FP32", max_queue=1, workers=1))
    models.append(
        make_model(
            "mean",
            lambda x: {
                "MEAN": x["IMAGE"].reshape(x["IMAGE"].shape[0], -1).mean(1, keepdims=True).astype(np.float32)
            },
            [("IMAGE", "UINT8", [-1, -1, 3])],
            [("MEAN", "FP32", [1])],
        )
    )
    with running_frontend(models, f"ipc://{sockdir}/fe.zmq", max_inflight_per_client=64) as running:
        yield running


@pytest.fixture
def client(server: RunningFrontend) -> Iterator[ZmqClient]:
    with ZmqClient(server.endpoint, timeout=5.0) as c:
        yield c


def gate(server: RunningFrontend, model: str) -> threading.Event:
    event = threading.Event()
    server.dataplane.repository.get(model).scheduler.gate = event  # type: ignore[attr-defined]
    return event


def ungate(server: RunningFrontend, model: str, event: threading.Event) -> None:
    event.set()
    server.dataplane.repository.get(model).scheduler.gate = None  # type: ignore[attr-defined]


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


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


def test_req_socket_works_one_at_a_time(server: RunningFrontend) -> None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.connect(server.endpoint)
    try:
        header = {
            "v": 1,
            "op": "infer",
            "id": "r1",
            "model": "id_uint8",
            "inputs": [{"name": "INPUT0", "datatype": "UINT8", "shape": [1, 3]}],
        }
        sock.send_multipart([wire.dumps(header), bytes([1, 2, 3])])
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
    assert info.value.status == "INTERNAL" and "should be at least 128 bytes" in info.value.message
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
        started = time.monotonic()
        with pytest.raises(ClientError) as info:
            client.infer("gated", {"INPUT0": np.ones((1, 4), np.float32)}, ring=ring, timeout=0.2)
        assert info.value.status == "DEADLINE_EXCEEDED"
        assert time.monotonic() - started < 2.0
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
        started = time.monotonic()
        with pytest.raises(ClientError) as info:
            second.result()
        assert time.monotonic() - started < 0.5  # told at once, not after the slow request
        assert info.value.status == "UNAVAILABLE" and "Exceeds maximum queue size" in info.value.message
        assert not first.done()
    finally:
        ungate(server, "tiny_queue", event)
    assert first.result().as_numpy("OUTPUT0").shape == (1, 4)


def test_in_flight_limit_per_client(server: RunningFrontend, client: ZmqClient) -> None:
    event = gate(server, "gated")
    try:
        futures = [client.submit("gated", {"INPUT0": np.ones((1, 1), np.float32)}) for _ in range(70)]
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
        header = {
            "v": 1,
            "op": "infer",
            "model": "id_uint8",
            "inputs": [{"name": "INPUT0", "datatype": "UINT8", "shape": [1, 65536]}],
        }
        payload = bytes(65536)
        for i in range(600):
            hog.send_multipart([wire.dumps({**header, "id": i}), payload])
        started = time.monotonic()
        for _ in range(20):
            client.infer("id_uint8", {"INPUT0": np.ones((1, 4), np.uint8)})
        assert time.monotonic() - started < 5.0
    finally:
        hog.close(linger=0)


# -- regions and client lifetime --------------------------------------------------------------------
def region_names(server: RunningFrontend) -> set[str]:
    return {r.name for r in server.call(server.registry.status)}


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_regions_belong_to_their_client(server: RunningFrontend) -> None:
    with ZmqClient(server.endpoint, timeout=5) as a, ZmqClient(server.endpoint, timeout=5) as b:
        ring = a.create_ring(slots=2, slot_size=64)
        mine = {r["name"]: r["mine"] for r in a.regions()}
        assert mine[ring.name] is True
        assert {r["name"]: r["mine"] for r in b.regions()}[ring.name] is False
        with pytest.raises(ClientError) as info:
            b.unregister_region(ring.name)
        assert info.value.status == "PERMISSION_DENIED"
        # ...but any client may use a registered region (as with Triton's system shm)
        slot = ring.acquire()
        result = b.infer("id_fp32", {"INPUT0": slot.write(np.ones((1, 16), np.float32))})
        assert result.as_numpy("OUTPUT0").sum() == 16
        with pytest.raises(ClientError) as info:
            a.register_region(ring.name, ring.key, ring.byte_size)
        assert info.value.status == "ALREADY_EXISTS"
        a.unregister_region(ring.name)
        assert ring.name not in region_names(server)
        a.unregister_region("never-registered")  # unknown names are fine (Triton)


def test_bye_releases_regions(server: RunningFrontend) -> None:
    client = ZmqClient(server.endpoint, timeout=5)
    ring = client.create_ring(slots=2, slot_size=64)
    assert ring.name in region_names(server)
    client.close()
    assert ring.name not in region_names(server)  # bye is answered after the release


def test_vanished_client_regions_are_released(server: RunningFrontend) -> None:
    client = ZmqClient(server.endpoint, timeout=5)
    ring = FrameRing(2, 64)
    try:
        client.register_ring(ring)
        assert ring.name in region_names(server)
        assert client._sock is not None
        client._sock.close(linger=0)  # gone without a bye, like a crashed process
        client._sock = None
        assert wait_until(lambda: ring.name not in region_names(server)), "regions of a gone client stayed"
        assert server.call(lambda: client.identity not in server.frontend._peers)
    finally:
        ring.close()


def test_unreachable_server_is_a_clear_error(sockdir: Path) -> None:
    with ZmqClient(f"ipc://{sockdir}/nobody.zmq", timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(ClientError) as info:
            client.ping()
        assert info.value.status == "UNAVAILABLE" and "cannot reach edgeserve" in info.value.message
        assert time.monotonic() - started < 2


# -- endpoints ---------------------------------------------------------------------------------------
def test_ipc_endpoint_folder_stale_socket_and_in_use(sockdir: Path) -> None:
    import socket

    path = sockdir / "deep" / "er" / "x.zmq"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.parent.mkdir(parents=True)
    stale.bind(str(path))
    stale.close()  # a socket file nobody listens on, left by a crash
    model = identity_model("m", "FP32")
    with running_frontend([model], f"ipc://{path}") as running:
        assert path.exists()
        with ZmqClient(running.endpoint, timeout=5) as client:
            assert client.ping()["status"] == "OK"
        with (
            pytest.raises(RuntimeError, match="in use by another running process"),
            running_frontend([identity_model("m", "FP32")], f"ipc://{path}"),
        ):
            pass
    assert not path.exists()  # removed at stop
    path.write_text("not a socket")
    with (
        pytest.raises(RuntimeError, match="exists and is not a socket"),
        running_frontend([identity_model("m", "FP32")], f"ipc://{path}"),
    ):
        pass


def test_tcp_endpoint_with_any_port() -> None:
    with running_frontend([identity_model("m", "INT16")], "tcp://127.0.0.1:*") as running:
        assert running.endpoint.startswith("tcp://127.0.0.1:") and not running.endpoint.endswith("*")
        with ZmqClient(running.endpoint, timeout=5) as client:
            data = np.arange(6, dtype=np.int16).reshape(1, 6)
            assert_same(client.infer("m", {"INPUT0": data}).as_numpy("OUTPUT0"), data)
            assert client.is_ready() and client.is_ready("m") and not client.is_ready("nope")
            meta = client.metadata("m")
            assert meta["inputs"] == [{"name": "INPUT0", "datatype": "INT16", "shape": [-1, -1]}]


def test_ring_header_generation_words_are_where_the_layout_says(client: ZmqClient) -> None:
    ring = client.create_ring(slots=3, slot_size=100)
    slot = ring.acquire()
    raw = bytes(ring.buf[: ring.layout.data_offset])
    assert raw[:8] == b"ESRING\x00\x01"
    assert struct.unpack_from("<Q", raw, ring.layout.generation_offset(slot.index))[0] == slot.gen
    assert ring.slot_size == 128 and ring.layout.data_offset == 4096


def test_large_ring_generation_words_past_the_first_page(client: ZmqClient) -> None:
    ring = client.create_ring(slots=600, slot_size=64)  # 600 generation words: past the first page
    assert ring.layout.generation_offset(599) + 8 > 4096
    slots = [ring.acquire() for _ in range(600)]
    last = slots[-1]
    data = np.arange(4, dtype=np.float32).reshape(1, 4)
    result = client.infer("id_fp32", {"INPUT0": last.write(data)}, {"OUTPUT0": slots[-2]})
    assert_same(result.as_numpy("OUTPUT0"), data)
    stale = last.write(data)
    ring._gens[last.index] += 1
    with pytest.raises(ClientError, match=r"slot 599 of ring .* was reused before the request was read"):
        client.infer("id_fp32", {"INPUT0": stale})


def test_async_client_timeout(server: RunningFrontend) -> None:
    event = gate(server, "gated")

    async def main() -> None:
        async with AsyncZmqClient(server.endpoint, timeout=5.0) as client:
            ring = await client.create_ring(slots=1, slot_size=64)
            with pytest.raises(ClientError) as info:
                await client.infer("gated", {"INPUT0": np.ones((1, 4), np.float32)}, ring=ring, timeout=0.2)
            assert info.value.status == "DEADLINE_EXCEEDED"
            slot = ring.try_acquire()  # the quarantined slot is the only one: reused, new generation
            assert slot is not None and slot.gen == 2
            slot.release()

    try:
        asyncio.run(main())
    finally:
        ungate(server, "gated", event)


def test_camera_pipeline_example(server: RunningFrontend, capsys: pytest.CaptureFixture[str]) -> None:
    from edgeserve.client.examples import camera_pipeline

    argv = [
        "--endpoint",
        server.endpoint,
        "--model",
        "mean",
        "--size",
        "48x64",
        "--frames",
        "12",
        "--fps",
        "200",
    ]
    assert camera_pipeline.main(argv) == 0
    out = capsys.readouterr().out
    assert "mean: input 'IMAGE' UINT8 [1, 48, 64, 3]" in out
    assert "frame     0 " in out and "result float32[1, 1]" in out
    assert "12 frames in" in out and "0 failed" in out
    assert (
        camera_pipeline.main([*argv[:-4], "--frames", "30", "--fps", "0", "--inflight", "2", "--quiet"]) == 0
    )
    assert "30 frames in" in capsys.readouterr().out


def test_client_survives_a_server_restart(sockdir: Path) -> None:
    endpoint = f"ipc://{sockdir}/restart.zmq"
    data = np.arange(8, dtype=np.float32).reshape(1, 8)
    with running_frontend([identity_model("m", "FP32")], endpoint) as first:
        client = ZmqClient(first.endpoint, timeout=3)
        ring = client.create_ring(slots=2, slot_size=64)
        assert_same(client.infer("m", {"INPUT0": data}, ring=ring).as_numpy("OUTPUT0"), data)
    try:
        with running_frontend([identity_model("m", "FP32")], endpoint) as second:
            assert ring.name not in region_names(second)  # a new server: an empty registry

            def answers() -> bool:
                try:
                    return client.ping(timeout=0.5)["status"] == "OK"
                except ClientError:
                    return False

            assert wait_until(answers)
            with pytest.raises(ClientError) as info:
                client.infer("m", {"INPUT0": data}, ring=ring)
            assert info.value.status == "NOT_FOUND" and ring.name in info.value.message
            # the next request registers the ring again, and works
            assert_same(client.infer("m", {"INPUT0": data}, ring=ring).as_numpy("OUTPUT0"), data)
            assert ring.name in region_names(second) and ring.free == 2
            client.close()
    finally:
        client.close()
