"""ZeroMQ frontend: regions and client lifetime, endpoints, large rings, timeouts, restarts, and the
camera example, over real sockets and real shared memory (zmq_harness models)."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import numpy as np
import pytest
from es_server import wait_until
from zmq_harness import (
    RunningFrontend,
    assert_same,
    gate,
    identity_model,
    region_names,
    running_frontend,
    ungate,
)

from edgeserve.client import AsyncZmqClient, ClientError, FrameRing, ZmqClient


# -- regions and client lifetime --------------------------------------------------------------------
def test_regions_belong_to_their_client(server: RunningFrontend) -> None:
    """A ZeroMQ region belongs to the socket that registered it (shm/binding.py): another client, even
    of the same user, neither sees, uses nor removes it."""
    with ZmqClient(server.endpoint, timeout=5) as a, ZmqClient(server.endpoint, timeout=5) as b:
        ring = a.create_ring(slots=2, slot_size=64)
        assert {r["name"]: r["mine"] for r in a.regions()} == {ring.name: True}
        assert ring.name not in {r["name"] for r in b.regions()}
        b.unregister_region(ring.name)  # answered as for an unknown name: nothing happens
        assert ring.name in region_names(server)
        slot = ring.acquire()
        with pytest.raises(ClientError) as info:
            b.infer("id_fp32", {"INPUT0": slot.write(np.ones((1, 16), np.float32))})
        assert info.value.status == "NOT_FOUND" and f"'{ring.name}'" in info.value.message
        result = a.infer("id_fp32", {"INPUT0": slot.write(np.ones((1, 16), np.float32))})
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
        with pytest.raises(ClientError) as info:
            client.ping()  # returns (bounded by its timeout); a hang would end at the test timeout
        assert info.value.status == "UNAVAILABLE" and "cannot reach edgeserve" in info.value.message


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
