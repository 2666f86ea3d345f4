"""Shared memory a client controls is hostile input: one real server process, real shm, and clients
that truncate, unlink or rewrite their regions, or die with requests in flight. The server must
answer a clear error naming the region, stay up and serve the next request (issue 13)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as tshm
from es_server import RunningServer, start_server
from onnx_models import write_model
from tritonclient.utils import InferenceServerException

from edgeserve.client import ClientError, ZmqClient
from edgeserve.client.ring import FrameRing, ShmTensor
from edgeserve.frontends.shm.ring import GEN

D = 256  # FP32 elements per request: 1 KiB
CONFIG = f"""
backend: "onnxruntime"
max_batch_size: 8
input {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {D} ] }}
output {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {D} ] }}
"""
# A lone request waits for a batch this long: the request is in flight while the client misbehaves.
SLOW = CONFIG + "dynamic_batching { max_queue_delay_microseconds: 600000 }\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    repo = tmp / "repo"
    write_model(repo, "ident", "identity", config=CONFIG)
    write_model(repo, "slow", "identity", config=SLOW)
    running = start_server(repo, tmp)
    try:
        yield running
    finally:
        assert running.alive(), running.log()[-3000:]
        running.stop()


@pytest.fixture
def region() -> Iterator[tuple[Any, str]]:
    """A 4 KiB /dev/shm region (Triton's system shared memory) and its file path."""
    key = f"/es_hostile_{uuid.uuid4().hex[:12]}"
    handle = tshm.create_shared_memory_region("r", key, 4096)
    try:
        yield handle, f"/dev/shm{key}"
    finally:
        with contextlib.suppress(Exception):  # a test may have unlinked it already
            tshm.destroy_shared_memory_region(handle)


def frame(seed: float = 1.0) -> np.ndarray:
    return (np.arange(D, dtype=np.float32) * seed).reshape(1, D)


def assert_serves(server: RunningServer) -> None:
    """The server is alive and answers a correct request on every frontend."""
    assert server.alive(), server.log()[-3000:]
    x = frame(3.0)
    inp = httpclient.InferInput("INPUT0", [1, D], "FP32")
    inp.set_data_from_numpy(x)
    result = httpclient.InferenceServerClient(server.http_url).infer("ident", [inp])
    assert np.array_equal(result.as_numpy("OUTPUT0"), x)
    ginp = grpcclient.InferInput("INPUT0", [1, D], "FP32")
    ginp.set_data_from_numpy(x)
    with grpcclient.InferenceServerClient(server.grpc_url) as cli:
        assert np.array_equal(cli.infer("ident", [ginp]).as_numpy("OUTPUT0"), x)
    with ZmqClient(server.zmq_endpoint, timeout=10.0) as zc:
        assert np.array_equal(zc.infer("ident", {"INPUT0": x}).as_numpy("OUTPUT0"), x)


# -- HTTP and gRPC: Triton system shared memory -----------------------------------------------------
def _http(
    server: RunningServer, name: str, in_offset: int | None, out_offset: int | None, model: str = "ident"
) -> Any:
    cli = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("INPUT0", [1, D], "FP32")
    if in_offset is None:
        inp.set_data_from_numpy(frame())
    else:
        inp.set_shared_memory(name, 4 * D, offset=in_offset)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    if out_offset is not None:
        out.set_shared_memory(name, 4 * D, offset=out_offset)
    return cli.infer(model, [inp], outputs=[out])


def _grpc(server: RunningServer, name: str, in_offset: int | None, out_offset: int | None) -> Any:
    with grpcclient.InferenceServerClient(server.grpc_url) as cli:
        inp = grpcclient.InferInput("INPUT0", [1, D], "FP32")
        if in_offset is None:
            inp.set_data_from_numpy(frame())
        else:
            inp.set_shared_memory(name, 4 * D, offset=in_offset)
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        if out_offset is not None:
            out.set_shared_memory(name, 4 * D, offset=out_offset)
        return cli.infer("ident", [inp], outputs=[out])


@pytest.mark.parametrize("frontend", ["http", "grpc"])
def test_truncated_or_shrunk_region_is_a_clear_error(
    server: RunningServer, region: tuple[Any, str], frontend: str
) -> None:
    handle, path = region
    name = f"{frontend}_{uuid.uuid4().hex[:6]}"
    if frontend == "http":
        admin: Any = httpclient.InferenceServerClient(server.http_url)
        call: Any = _http
        bad = "400"
    else:
        admin = grpcclient.InferenceServerClient(server.grpc_url)
        call = _grpc
        bad = "StatusCode.INVALID_ARGUMENT"
    tshm.set_shared_memory_region(handle, [frame(2.0)])
    admin.register_system_shared_memory(name, handle._shm_key, 4096)
    try:
        call(server, name, 0, 2048)  # in at 0, out at 2048: a correct request first
        assert np.array_equal(tshm.get_contents_as_numpy(handle, np.float32, [1, D], offset=2048), frame(2.0))

        os.truncate(path, 1536)  # shrink below the output's offset: the input still fits
        with pytest.raises(InferenceServerException) as info:
            call(server, name, 0, 2048)
        assert str(info.value.status()) == bad and name in info.value.message()
        assert "truncated" in info.value.message() and "1536 bytes" in info.value.message()
        assert os.stat(path).st_size == 1536  # the server never grows the client's file

        os.truncate(path, 0)  # now the input too
        for in_offset, out_offset in ((0, None), (1024, None), (None, 0)):
            with pytest.raises(InferenceServerException) as info:
                call(server, name, in_offset, out_offset)
            assert str(info.value.status()) == bad and name in info.value.message(), info.value.message()
        assert_serves(server)

        os.truncate(path, 4096)  # grown back: works again (zeros where the data was)
        result = call(server, name, 0, None)
        assert np.array_equal(result.as_numpy("OUTPUT0"), np.zeros((1, D), np.float32))
        os.unlink(path)  # unlinked: the server's reference keeps the memory until unregistered
        assert call(server, name, 0, None).as_numpy("OUTPUT0") is not None
    finally:
        admin.unregister_system_shared_memory(name)
        if frontend == "grpc":
            admin.close()
    assert_serves(server)


def test_output_region_truncated_while_the_request_is_in_flight(
    server: RunningServer, region: tuple[Any, str]
) -> None:
    handle, path = region
    cli = httpclient.InferenceServerClient(server.http_url)
    cli.register_system_shared_memory("inflight", handle._shm_key, 4096)
    try:
        inp = httpclient.InferInput("INPUT0", [1, D], "FP32")
        inp.set_shared_memory("inflight", 4 * D, offset=0)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        out.set_shared_memory("inflight", 4 * D, offset=2048)
        pending = cli.async_infer("slow", [inp], outputs=[out])  # waits ~0.6 s for a batch
        time.sleep(0.2)
        os.truncate(path, 0)
        with pytest.raises(InferenceServerException) as info:
            pending.get_result()
        assert "inflight" in info.value.message() and "truncated" in info.value.message()
    finally:
        cli.unregister_system_shared_memory("inflight")
    assert_serves(server)


def test_register_errors_are_4xx_naming_the_key(server: RunningServer, region: tuple[Any, str]) -> None:
    handle, _ = region
    cli = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as info:
        cli.register_system_shared_memory("missing", "/es_hostile_no_such_key", 64)
    assert info.value.status() == "404" and "/es_hostile_no_such_key" in info.value.message()
    for key in ("/../etc/passwd", "memfd:x:1:0", f"memfd:nope:{os.getpid()}:0", "memfd:bad name:1:2"):
        with pytest.raises(InferenceServerException) as info:
            cli.register_system_shared_memory("bad", key, 64)
        assert info.value.status() in ("400", "403", "404"), (key, info.value.message())
    cli.register_system_shared_memory("edge", handle._shm_key, 4096)
    try:
        for offset, size in ((4096, 4), (4000, 1024), (2**40, 4), (0, 2**40)):
            inp = httpclient.InferInput("INPUT0", [1, D], "FP32")
            inp.set_shared_memory("edge", size, offset=offset)
            with pytest.raises(InferenceServerException) as info:
                cli.infer("ident", [inp])
            assert info.value.status() == "400" and "'edge'" in info.value.message(), info.value.message()
    finally:
        cli.unregister_system_shared_memory("edge")
    assert_serves(server)


# -- ZeroMQ: rings and regions ----------------------------------------------------------------------
def test_sealed_ring_cannot_be_truncated_and_is_read_in_place(server: RunningServer) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=10.0) as client:
        ring = client.create_ring(slots=4, slot_size=4 * D)
        assert ring.sealed and ring.key.startswith("memfd:")
        with pytest.raises(PermissionError):
            os.ftruncate(ring._fd, 0)
        slot = ring.acquire()
        slot.ndarray((1, D), np.float32)[:] = frame(5.0)
        out = client.infer("ident", {"INPUT0": slot.tensor((1, D), np.float32)}, outputs={"OUTPUT0": ring})
        assert np.array_equal(out.as_numpy("OUTPUT0"), frame(5.0))
    assert_serves(server)


@pytest.mark.parametrize("what", ["input", "output", "plain"])
def test_truncated_unsealed_ring_or_region_is_a_clear_error(server: RunningServer, what: str) -> None:
    with ZmqClient(server.zmq_endpoint, timeout=10.0) as client:
        ring = FrameRing(4, 4 * D, sealed=False)  # a /dev/shm segment: the server copies, never maps
        try:
            client.register_ring(ring)
            path = f"/dev/shm/{ring.key}"
            slot = ring.acquire()
            slot.ndarray((1, D), np.float32)[:] = frame(4.0)
            out = client.infer(
                "ident", {"INPUT0": slot.tensor((1, D), np.float32)}, outputs={"OUTPUT0": ring}
            )
            assert np.array_equal(out.as_numpy("OUTPUT0"), frame(4.0))  # copy in, pwrite out: correct
            slot = ring.acquire()
            if what == "input":
                os.truncate(path, ring.layout.slot_offset(slot.index) + 16)
                inputs: dict[str, Any] = {"INPUT0": slot.tensor((1, D), np.float32)}
                outputs: Any = None
            elif what == "output":
                # every slot cut short (the ring hands out whichever slot it last took back), the
                # header page with the generation words kept
                os.truncate(path, ring.layout.slot_offset(0) + 16)
                inputs, outputs = {"INPUT0": frame()}, {"OUTPUT0": ring}
            else:
                client.register_region(f"{ring.name}-plain", ring.key, ring.byte_size)
                os.truncate(path, 0)
                plain = ShmTensor(f"{ring.name}-plain", 4 * D, 8192, "FP32", (1, D))  # a region reference
                inputs, outputs = {"INPUT0": plain}, None
            with pytest.raises(ClientError) as info:
                client.infer("ident", inputs, outputs=outputs)
            assert info.value.status == "INVALID_ARG" and ring.name in info.value.message, info.value.message
        finally:
            ring.close()
    assert_serves(server)


def test_slot_rewritten_mid_flight(server: RunningServer) -> None:
    """What a producer that rewrites a slot while its request is in flight gets (docs/zmq.md, shm rules)."""
    with ZmqClient(server.zmq_endpoint, timeout=10.0) as client:
        for sealed in (True, False):
            ring = client.create_ring(slots=4, slot_size=4 * D) if sealed else None
            if ring is None:
                ring = client.register_ring(FrameRing(4, 4 * D, sealed=False))
            # 1. rewritten and the generation bumped (the slot was taken again): the request fails
            slot = ring.acquire()
            slot.ndarray((1, D), np.float32)[:] = frame(1.0)
            future = client.submit("slow", {"INPUT0": slot.tensor((1, D), np.float32)})
            time.sleep(0.2)
            GEN.pack_into(ring.buf, ring.layout.generation_offset(slot.index), slot.gen + 1)
            slot.ndarray((1, D), np.float32)[:] = frame(7.0)
            with pytest.raises(ClientError) as info:
                future.result()
            assert info.value.status == "INVALID_ARG" and "reused while the request was in flight" in (
                info.value.message
            )
            # 2. rewritten without bumping the generation: the result of the bytes the model read --
            # in a sealed ring read in place when the batch runs (here: the new bytes), in a /dev/shm
            # segment copied when the request arrived (the old bytes). Never a crash, never another
            # client's data.
            slot = ring.acquire()
            slot.ndarray((1, D), np.float32)[:] = frame(1.0)
            future = client.submit("slow", {"INPUT0": slot.tensor((1, D), np.float32)})
            time.sleep(0.2)
            slot.ndarray((1, D), np.float32)[:] = frame(7.0)
            got = future.result().as_numpy("OUTPUT0")
            assert np.array_equal(got, frame(7.0) if sealed else frame(1.0))
            if not sealed:
                ring.close()
    assert_serves(server)


# -- a client that dies with regions and requests in flight ------------------------------------------
_DYING = r"""
import sys, time, numpy as np
import tritonclient.utils.shared_memory as tshm
from edgeserve.client import ZmqClient
client = ZmqClient(sys.argv[1], timeout=30.0)
ring = client.create_ring(slots=8, slot_size=4096)
plain = tshm.create_shared_memory_region("p", sys.argv[2], 4096)
client.register_region(sys.argv[2].lstrip("/"), sys.argv[2], 4096)
futures = []
for i in range(8):
    slot = ring.acquire()
    slot.ndarray((1, 256), np.float32)[:] = i
    futures.append(client.submit("slow", {"INPUT0": slot.tensor((1, 256), np.float32)}))
print(ring.name, ring.key, flush=True)
time.sleep(60)
"""


def _server_fd_targets(server: RunningServer) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{server.process.pid}/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/{server.process.pid}/fd/{fd}"))
    return targets


def test_client_killed_with_regions_and_requests_in_flight(server: RunningServer, tmp_path: Path) -> None:
    key = f"/es_dying_{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING, server.zmq_endpoint, key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ring_name, _ring_key = proc.stdout.readline().split()
        with ZmqClient(server.zmq_endpoint, timeout=10.0) as other:
            names = server.shm_regions()  # another client's status would not list them
            assert {ring_name, key.lstrip("/")} <= names
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                names = server.shm_regions()
                if not names & {ring_name, key.lstrip("/")}:
                    break
                other.infer("ident", {"INPUT0": frame()})  # other clients are served meanwhile
                time.sleep(0.1)
            assert not names & {ring_name, key.lstrip("/")}, names
            # the killed client's in-flight requests finish; their leases go, then the memory
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                leaked = [t for t in _server_fd_targets(server) if key.lstrip("/") in t or ring_name in t]
                if not leaked:
                    break
                other.infer("ident", {"INPUT0": frame()})
                time.sleep(0.2)
            assert not leaked, leaked
            with open(f"/proc/{server.process.pid}/maps") as maps:
                assert ring_name not in maps.read()  # the memfd mapping is gone: no leak
    finally:
        if proc.poll() is None:
            proc.kill()
        if os.path.exists(f"/dev/shm{key}"):
            os.unlink(f"/dev/shm{key}")
    assert_serves(server)
