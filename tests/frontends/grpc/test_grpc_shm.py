"""System shared memory over gRPC (Triton extension), with tritonclient's own shm helpers."""

from __future__ import annotations

import os
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from grpc_fakes import Client, InProcessServer, make_plane
from tritonclient.utils import InferenceServerException

from edgeserve.frontends.shm.registry import SharedMemoryRegistry


@pytest.fixture
def region() -> Iterator[Any]:
    """A 1 KiB client-owned region; the test's key is unique."""
    key = f"/edgeserve_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("data", key, 1024)
    try:
        yield handle
    finally:
        shm.destroy_shared_memory_region(handle)


def status_of(info: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(info.value.status())


def test_inputs_and_outputs_in_shared_memory(client: Client, region: Any) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    shm.set_shared_memory_region(region, [a, b])  # a at 0, b at 64
    client.register_system_shared_memory("data", region._shm_key, 1024)
    status = client.get_system_shared_memory_status()
    assert status.regions["data"].byte_size == 1024 and status.regions["data"].key == region._shm_key

    in0 = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("data", 64)
    in1 = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_shared_memory("data", 64, offset=64)
    out0 = grpcclient.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("data", 64, offset=128)
    out1 = grpcclient.InferRequestedOutput("OUTPUT1")  # raw
    result = client.infer("simple", [in0, in1], outputs=[out0, out1])
    response = result.get_response()
    assert len(response.raw_output_contents) == 2 and response.raw_output_contents[0] == b""
    assert np.array_equal(shm.get_contents_as_numpy(region, np.int32, [1, 16], offset=128), a + b)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)

    # one input in shm, the other raw: the raw entry is the first non-shm input's
    raw1 = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    raw1.set_data_from_numpy(b * 2)
    result = client.infer("simple", [in0, raw1])
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b * 2)
    client.unregister_system_shared_memory("data")
    assert len(client.get_system_shared_memory_status().regions) == 0


def test_register_errors(client: Client, region: Any) -> None:
    client.register_system_shared_memory("data", region._shm_key, 512, offset=256)
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("data", region._shm_key, 64)
    assert status_of(info) == "StatusCode.ALREADY_EXISTS"
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("other", "/edgeserve_no_such_key", 64)
    assert status_of(info) == "StatusCode.NOT_FOUND" and "Unable to open" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("big", region._shm_key, 1024, offset=512)  # past the end
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.register_system_shared_memory("slashes", "///", 64)
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.get_system_shared_memory_status("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"
    client.unregister_system_shared_memory("nope")  # unknown names are fine, as in Triton
    client.unregister_system_shared_memory()
    assert len(client.get_system_shared_memory_status().regions) == 0


def test_bad_references_at_infer_time(client: Client, region: Any) -> None:
    client.register_system_shared_memory("data", region._shm_key, 256)

    def infer_with(region_name: str, size: int, offset: int, out_size: int | None = None) -> str:
        in0 = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        in0.set_shared_memory(region_name, size, offset=offset)
        in1 = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
        in1.set_data_from_numpy(np.zeros((1, 16), np.int32))
        outputs = None
        if out_size is not None:
            out = grpcclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("data", out_size)
            outputs = [out]
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", [in0, in1], outputs=outputs)
        return status_of(info)

    assert infer_with("unknown", 64, 0) == "StatusCode.NOT_FOUND"
    assert infer_with("data", 64, 256) == "StatusCode.INVALID_ARGUMENT"  # offset at the end
    assert infer_with("data", 64, 224) == "StatusCode.INVALID_ARGUMENT"  # offset + size past the end
    assert infer_with("data", 60, 0) == "StatusCode.INVALID_ARGUMENT"  # wrong byte size for the shape
    assert infer_with("data", 64, 10**15) == "StatusCode.INVALID_ARGUMENT"
    assert infer_with("data", 64, 0, out_size=32) == "StatusCode.INVALID_ARGUMENT"  # output does not fit
    assert client.is_server_ready()


def _unregister_during_request(client: Client, region: Any, shm_output: bool) -> tuple[Any, Any]:
    shm.set_shared_memory_region(region, [np.array([[300]], dtype=np.int32)])
    client.register_system_shared_memory("data", region._shm_key, 1024)
    done: queue.Queue[Any] = queue.Queue()
    tensor = grpcclient.InferInput("DELAY_MS", [1, 1], "INT32")
    tensor.set_shared_memory("data", 4)
    out = grpcclient.InferRequestedOutput("OUT")
    if shm_output:
        out.set_shared_memory("data", 4, offset=512)
    client.async_infer("sleep", [tensor], lambda result, error: done.put((result, error)), outputs=[out])
    time.sleep(0.1)
    client.unregister_system_shared_memory("data")  # while the request still uses the region
    assert len(client.get_system_shared_memory_status().regions) == 0
    result, error = done.get(timeout=10)
    return result, error


def test_unregister_while_input_in_flight_is_safe(client: Client, region: Any) -> None:
    result, error = _unregister_during_request(client, region, shm_output=False)
    assert error is None and int(result.as_numpy("OUT")[0, 0]) == 300


def test_unregister_while_output_in_flight_is_safe(client: Client, region: Any) -> None:
    _result, error = _unregister_during_request(client, region, shm_output=True)
    assert error is None, f"{error.status()}: {error.message()}"
    assert int(shm.get_contents_as_numpy(region, np.int32, [1], offset=512)[0]) == 300


def test_region_is_never_unlinked(tmp_path: Path) -> None:
    plane, repo = make_plane(tmp_path)
    server = InProcessServer(plane)
    key = f"/edgeserve_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("data", key, 128)
    try:
        client = grpcclient.InferenceServerClient(server.url)
        client.register_system_shared_memory("data", key, 128)
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("data", key, 128)
        client.close()
        server.close()  # stops with the region still registered
        assert os.path.exists("/dev/shm/" + key.lstrip("/"))
    finally:
        shm.destroy_shared_memory_region(handle)
        repo.pool.shutdown(wait=False)


def test_key_prefix_restriction_and_foreign_regions(tmp_path: Path, region: Any) -> None:
    plane, repo = make_plane(tmp_path)
    plane.shm = SharedMemoryRegistry(key_prefixes=["camera_"])
    server = InProcessServer(plane)
    try:
        client = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("data", region._shm_key, 64)
        assert status_of(info) == "StatusCode.PERMISSION_DENIED"
        # a region another frontend (a ZeroMQ client's ring) owns is not the Triton protocol's to see or drop
        open_plane_registry = SharedMemoryRegistry()
        plane.shm = open_plane_registry
        open_plane_registry.register("ring", region._shm_key, 0, 64, owner="zmq-client-1")
        client.register_system_shared_memory("mine", region._shm_key, 64)
        assert set(client.get_system_shared_memory_status().regions) == {"mine"}
        client.unregister_system_shared_memory()
        client.unregister_system_shared_memory("ring")
        assert open_plane_registry.names() == ["ring"]
        open_plane_registry.close()
        client.close()
    finally:
        server.close()
        repo.pool.shutdown(wait=False)


def test_huge_bytes_shape_in_shared_memory_is_invalid_arg(tmp_path: Path, region: Any) -> None:
    plane, repo = make_plane(tmp_path)
    server = InProcessServer(plane)
    try:
        client = grpcclient.InferenceServerClient(server.url)
        client.register_system_shared_memory("data", region._shm_key, 64)
        tensor = grpcclient.InferInput("TEXT", [2**40], "BYTES")
        tensor.set_shared_memory("data", 64)
        with pytest.raises(InferenceServerException) as info:
            client.infer("echo", [tensor])
        assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
        client.close()
    finally:
        server.close()
        repo.pool.shutdown(wait=False)
