"""Compatibility suite: the real `python -m edgeserve run` (real repository, scheduler, ONNX Runtime)
driven by the real tritonclient, gRPC and HTTP flavours, as Triton-speaking apps would drive it."""

from __future__ import annotations

import json
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from es_server import RunningServer, ServerFactory
from grpc_fakes import add_sub_inputs
from onnx_models import write_model
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from edgeserve.protocol.datatypes import DATATYPES as DATATYPES_ALL

pytestmark = pytest.mark.timeout(300)

DATATYPES = [d for d in DATATYPES_ALL if d != "BF16"]  # ORT cannot pass bf16 to numpy
CONFIG_TYPE = {"BYTES": "TYPE_STRING"}

SIMPLE = """
name: "simple"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
        { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
         { name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] } ]
"""
IMAGE = """
name: "image"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "images", data_type: TYPE_FP32, format: FORMAT_NCHW, dims: [ 3, -1, -1 ] } ]
output [ { name: "features", data_type: TYPE_FP32, dims: [ 4, -1, -1 ] } ]
"""
FRAME = """
name: "frame"
backend: "onnxruntime"
max_batch_size: 1
input [ { name: "INPUT0", data_type: TYPE_UINT8, dims: [ 2160, 3840, 3 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_UINT8, dims: [ 2160, 3840, 3 ] } ]
"""


def identity_config(name: str, datatype: str) -> str:
    t = CONFIG_TYPE.get(datatype, f"TYPE_{datatype}")
    return (
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        f'input [ {{ name: "INPUT0", data_type: {t}, dims: [ -1 ] }} ]\n'
        f'output [ {{ name: "OUTPUT0", data_type: {t}, dims: [ -1 ] }} ]\n'
    )


def build_repository(root: Path, datatypes: list[str] | None = None, frame: bool = False) -> Path:
    repo = root / "repo"
    write_model(repo, "simple", "add_sub", config=SIMPLE, datatype="INT32", dims=16)
    write_model(repo, "image", "conv", config=IMAGE)
    for datatype in datatypes or []:
        name = f"id_{datatype.lower()}"
        write_model(repo, name, "identity", config=identity_config(name, datatype), datatype=datatype)
    if frame:
        write_model(repo, "frame", "identity", config=FRAME, datatype="UINT8", shape=["N", 2160, 3840, 3])
    return repo


def grpc_client(server: RunningServer) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


Served = tuple[RunningServer, grpcclient.InferenceServerClient]


@pytest.fixture
def served(server_factory: ServerFactory, tmp_path: Path) -> Iterator[Served]:
    """The default repository served, and a gRPC client of it (closed afterwards)."""
    server = server_factory(build_repository(tmp_path))
    client = grpc_client(server)
    yield server, client
    client.close()


def make_client(flavour: str, server: RunningServer) -> Any:
    if flavour == "grpc":
        return grpcclient.InferenceServerClient(server.grpc_url)
    return httpclient.InferenceServerClient(server.http_url, concurrency=8)


def module(flavour: str) -> Any:
    return grpcclient if flavour == "grpc" else httpclient


def simple_inputs(flavour: str, a: np.ndarray, b: np.ndarray) -> list[Any]:
    return add_sub_inputs(a, b, module(flavour))


def example(datatype: str, rows: int = 2, cols: int = 5) -> np.ndarray:
    rng = np.random.default_rng(7)
    if datatype == "BYTES":
        return np.array(
            [[f"s{r}-{c}-ü".encode() * (c % 3) for c in range(cols)] for r in range(rows)], dtype=np.object_
        )
    if datatype == "BOOL":
        return rng.integers(0, 2, (rows, cols)).astype(bool)
    from tritonclient.utils import triton_to_np_dtype

    dtype = np.dtype(triton_to_np_dtype(datatype))
    if dtype.kind == "f":
        return rng.standard_normal((rows, cols)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), (rows, cols), dtype=dtype, endpoint=True)


def status_of(info: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(info.value.status())


# -- metadata, config, health ------------------------------------------------------------------------
def test_every_read_only_rpc(served: Served) -> None:
    server, client = served
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta.name and "system_shared_memory" in meta.extensions and "model_repository" in meta.extensions
    model = client.get_model_metadata("image")
    assert list(model.versions) == ["1"] and model.platform
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("images", "FP32", [-1, 3, -1, -1])
    ]
    config = client.get_model_config("image").config
    assert config.max_batch_size == 4 and config.input[0].format == config.input[0].FORMAT_NCHW
    assert list(config.input[0].dims) == [3, -1, -1] and config.output[0].name == "features"
    as_json = client.get_model_config("simple", as_json=True)["config"]
    assert as_json["max_batch_size"] == 8 and as_json["input"][0]["data_type"] == "TYPE_INT32"
    index = {(m.name, m.state) for m in client.get_model_repository_index().models}
    assert {("simple", "READY"), ("image", "READY")} <= index
    assert len(client.get_system_shared_memory_status().regions) == 0
    assert len(client.get_cuda_shared_memory_status().regions) == 0
    assert "log_info" in client.get_log_settings(as_json=True)["settings"]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"


# -- inference -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["grpc", "http"])
def test_infer_each_datatype(server_factory: ServerFactory, tmp_path: Path, flavour: str) -> None:
    server = server_factory(build_repository(tmp_path, DATATYPES))
    client = make_client(flavour, server)
    mod = module(flavour)
    for datatype in DATATYPES:
        value = example(datatype)
        tensor = mod.InferInput("INPUT0", list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        result = client.infer(f"id_{datatype.lower()}", [tensor])
        out = result.as_numpy("OUTPUT0")
        assert out.shape == value.shape, datatype
        if datatype == "BYTES":
            assert out.tolist() == value.tolist()
        else:
            assert out.dtype == value.dtype and np.array_equal(out, value), datatype
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    result = client.infer("simple", simple_inputs(flavour, a, a * 3), request_id="abc")
    assert np.array_equal(result.as_numpy("OUTPUT0"), a * 4) and np.array_equal(
        result.as_numpy("OUTPUT1"), -2 * a
    )
    client.close()


@pytest.mark.parametrize("flavour", ["grpc", "http"])
def test_many_concurrent_async_infers(server_factory: ServerFactory, tmp_path: Path, flavour: str) -> None:
    server = server_factory(build_repository(tmp_path))
    client = make_client(flavour, server)
    values = [np.full((1, 16), i, dtype=np.int32) for i in range(200)]
    if flavour == "grpc":
        answers: queue.Queue[Any] = queue.Queue()
        for i, value in enumerate(values):
            client.async_infer(
                "simple",
                simple_inputs(flavour, value, value),
                lambda result, error, i=i: answers.put((i, result, error)),
            )
        got = [answers.get(timeout=60) for _ in values]
    else:
        pending = [
            (i, client.async_infer("simple", simple_inputs(flavour, v, v))) for i, v in enumerate(values)
        ]
        got = [(i, p.get_result(timeout=60), None) for i, p in pending]
    for i, result, error in got:
        assert error is None
        assert np.array_equal(result.as_numpy("OUTPUT0"), values[i] * 2)
    client.close()


def test_stream_of_500_with_interleaved_errors(served: Served) -> None:
    client = served[1]
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    expected: dict[str, np.ndarray] = {}
    bad = 0
    for i in range(500):
        value = np.full((1, 16), i, dtype=np.int32)
        if i % 7 == 3:
            client.async_stream_infer("missing", simple_inputs("grpc", value, value), request_id=f"bad{i}")
            bad += 1
        elif i % 7 == 5:
            wrong = grpcclient.InferInput("INPUT0", [1, 15], "INT32")
            wrong.set_data_from_numpy(np.zeros((1, 15), np.int32))
            client.async_stream_infer(
                "simple", [wrong, simple_inputs("grpc", value, value)[1]], request_id=f"bad{i}"
            )
            bad += 1
        else:
            client.async_stream_infer("simple", simple_inputs("grpc", value, value), request_id=f"ok{i}")
            expected[f"ok{i}"] = value * 2
    got = [answers.get(timeout=120) for _ in range(500)]
    errors = [e for r, e in got if e is not None]
    assert len(errors) == bad
    for result, error in got:
        if error is None:
            response = result.get_response()
            assert response.parameters["triton_final_response"].bool_param
            assert np.array_equal(result.as_numpy("OUTPUT0"), expected.pop(response.id))
    assert not expected
    client.stop_stream()


def test_four_k_frame_round_trip(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = server_factory(build_repository(tmp_path, frame=True))
    client = grpc_client(server)
    frame = np.random.default_rng(3).integers(0, 255, (1, 2160, 3840, 3), dtype=np.uint8)
    tensor = grpcclient.InferInput("INPUT0", list(frame.shape), "UINT8")
    tensor.set_data_from_numpy(frame)
    result = client.infer("frame", [tensor])
    assert np.array_equal(result.as_numpy("OUTPUT0"), frame)
    client.close()


def test_scheduling_and_sequence_parameters_are_accepted(served: Served) -> None:
    client = served[1]
    value = np.ones((1, 16), dtype=np.int32)
    for kwargs in (
        {"priority": 1, "timeout": 10_000_000},
        {"sequence_id": 7, "sequence_start": True},
        {"sequence_id": "cam-2", "sequence_end": True},
        {"parameters": {"camera": "gate", "k": 2}},
    ):
        result = client.infer("simple", simple_inputs("grpc", value, value), **kwargs)
        assert np.array_equal(result.as_numpy("OUTPUT0"), value * 2)


# -- statistics -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["grpc", "http"])
def test_statistics_add_up(server_factory: ServerFactory, tmp_path: Path, flavour: str) -> None:
    server = server_factory(build_repository(tmp_path))
    client = make_client(flavour, server)
    rows = 0
    for i in range(12):
        batch = 1 + i % 3
        value = np.full((batch, 16), i, dtype=np.int32)
        client.infer("simple", simple_inputs(flavour, value, value))
        rows += batch
    for _ in range(3):  # failures: wrong shape
        with pytest.raises(InferenceServerException):
            client.infer(
                "simple", simple_inputs(flavour, np.zeros((1, 16), np.int32), np.zeros((2, 16), np.int32))
            )
    grpc_stats = grpc_client(server).get_inference_statistics("simple", as_json=True)["model_stats"]
    assert len(grpc_stats) == 1
    stats = grpc_stats[0]
    inference = stats["inference_stats"]
    assert int(inference["success"]["count"]) == 12 and int(inference["fail"]["count"]) == 3
    assert int(stats["inference_count"]) == rows
    assert int(inference["queue"]["count"]) == 12 and int(inference["compute_infer"]["count"]) == 12
    batches = stats.get("batch_stats", [])
    assert sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in batches) == rows
    assert sum(int(b["compute_infer"]["count"]) for b in batches) == int(stats["execution_count"])
    if flavour == "http":  # the same numbers over HTTP
        http_stats = client.get_inference_statistics("simple")["model_stats"][0]
        assert http_stats["inference_count"] == rows
        assert http_stats["inference_stats"]["success"]["count"] == 12
    client.close()


# -- shared memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["grpc", "http"])
def test_shared_memory_inputs_and_outputs(
    server_factory: ServerFactory, tmp_path: Path, flavour: str
) -> None:
    server = server_factory(build_repository(tmp_path))
    client = make_client(flavour, server)
    key = f"/edgeserve_compat_{uuid.uuid4().hex[:10]}"
    handle = shm.create_shared_memory_region("io", key, 512)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.full((1, 16), 5, dtype=np.int32)
        shm.set_shared_memory_region(handle, [a, b])
        grpc_client(server).register_system_shared_memory("io", key, 512)  # registered over gRPC ...
        mod = module(flavour)
        in0, in1 = mod.InferInput("INPUT0", [1, 16], "INT32"), mod.InferInput("INPUT1", [1, 16], "INT32")
        in0.set_shared_memory("io", 64)
        in1.set_shared_memory("io", 64, offset=64)
        out0 = mod.InferRequestedOutput("OUTPUT0")
        out0.set_shared_memory("io", 64, offset=128)
        out1 = mod.InferRequestedOutput("OUTPUT1")
        out1.set_shared_memory("io", 64, offset=192)
        client.infer("simple", [in0, in1], outputs=[out0, out1])  # ... used over either frontend
        assert np.array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128), a + b)
        assert np.array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=192), a - b)
        status = grpc_client(server).get_system_shared_memory_status()
        assert status.regions["io"].key == key and status.regions["io"].byte_size == 512
        client.unregister_system_shared_memory("io")
        assert len(grpc_client(server).get_system_shared_memory_status().regions) == 0
    finally:
        shm.destroy_shared_memory_region(handle)
    client.close()


def test_shared_memory_errors(served: Served) -> None:
    client = served[1]
    key = f"/edgeserve_compat_{uuid.uuid4().hex[:10]}"
    handle = shm.create_shared_memory_region("io", key, 256)
    try:
        client.register_system_shared_memory("io", key, 256)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("io", key, 256)
        assert status_of(info) == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("x", "/edgeserve_compat_missing", 64)
        assert status_of(info) == "StatusCode.NOT_FOUND"  # Triton: INTERNAL; a missing key is the client's
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("x", key, 512)
        assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("x")
        assert status_of(info) == "StatusCode.NOT_FOUND"
        client.unregister_system_shared_memory("x")

        def shm_infer(region: str, offset: int, size: int = 64) -> str:
            in0 = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
            in0.set_shared_memory(region, size, offset=offset)
            in1 = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
            in1.set_data_from_numpy(np.zeros((1, 16), np.int32))
            with pytest.raises(InferenceServerException) as info:
                client.infer("simple", [in0, in1])
            return status_of(info)

        assert shm_infer("unknown", 0) == "StatusCode.NOT_FOUND"
        assert shm_infer("io", 256) == "StatusCode.INVALID_ARGUMENT"
        assert shm_infer("io", 224) == "StatusCode.INVALID_ARGUMENT"
        assert shm_infer("io", 0, size=32) == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as info:
            client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)
        assert status_of(info) == "StatusCode.UNIMPLEMENTED"
        client.unregister_system_shared_memory()
        assert client.is_server_ready()
    finally:
        shm.destroy_shared_memory_region(handle)


# -- repository -------------------------------------------------------------------------------------------
def test_load_unload_with_config_override_and_files(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = server_factory(build_repository(tmp_path), args=["--model-control-mode", "explicit"])
    client = grpc_client(server)
    override = json.loads(json.dumps(client.get_model_config("simple", as_json=True)["config"]))
    override["max_batch_size"] = 2
    override.pop("dynamic_batching", None)
    client.load_model("simple", config=json.dumps(override))
    assert client.get_model_config("simple").config.max_batch_size == 2
    value = np.ones((3, 16), dtype=np.int32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", simple_inputs("grpc", value, value))  # batch 3 > 2 now
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"

    # a model that is not in the repository at all: config + files sent with the request
    model_file = tmp_path / "repo" / "simple" / "1" / "model.onnx"
    config = {
        "name": "uploaded",
        "backend": "onnxruntime",
        "max_batch_size": 4,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
    }
    client.load_model(
        "uploaded", config=json.dumps(config), files={"file:1/model.onnx": model_file.read_bytes()}
    )
    assert client.is_model_ready("uploaded")
    value = np.full((1, 16), 4, dtype=np.int32)
    assert np.array_equal(
        client.infer("uploaded", simple_inputs("grpc", value, value)).as_numpy("OUTPUT0"), value * 2
    )
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index.get("uploaded") == "READY"

    client.unload_model("uploaded")
    deadline = time.monotonic() + 30
    while client.is_model_ready("uploaded") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.is_model_ready("uploaded")
    with pytest.raises(InferenceServerException) as info:
        client.infer("uploaded", simple_inputs("grpc", value, value))
    assert status_of(info) in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE")
    with pytest.raises(InferenceServerException) as info:
        client.load_model(
            "broken", config=json.dumps({"backend": "onnxruntime"}), files={"file:1/model.onnx": b"junk"}
        )
    assert status_of(info) != "StatusCode.OK"
    assert client.is_server_live() and client.is_model_ready("simple")
    client.close()


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_input_gets_the_right_status_and_the_server_keeps_serving(served: Served) -> None:
    server, client = served

    def raw(method: str, payload: bytes) -> grpc.StatusCode:
        with grpc.insecure_channel(server.grpc_url) as channel:
            try:
                channel.unary_unary(f"/inference.GRPCInferenceService/{method}")(payload, timeout=30)
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    for garbage in (b"\x0a\xff\xff", b"\xff" * 16, b"\x3a\xff\xff\xff\xff\x0f", b"\x0a\x02\xc3\x28"):
        assert raw("ModelInfer", garbage) == grpc.StatusCode.INTERNAL
        assert raw("ModelConfig", garbage) == grpc.StatusCode.INTERNAL

    def request(shape: list[int], size: int, datatype: str = "INT32") -> bytes:
        msg = service_pb2.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
            msg.raw_input_contents.append(b"\1" * size)
        return bytes(msg.SerializeToString())

    assert raw("ModelInfer", request([1, 16], 63)) == grpc.StatusCode.INVALID_ARGUMENT  # wrong size
    assert raw("ModelInfer", request([1, 17], 68)) == grpc.StatusCode.INVALID_ARGUMENT  # wrong shape
    assert raw("ModelInfer", request([2**31, 2**31], 64)) == grpc.StatusCode.INVALID_ARGUMENT  # huge
    assert raw("ModelInfer", request([2**40], 64, "BYTES")) == grpc.StatusCode.INVALID_ARGUMENT  # huge BYTES
    assert raw("ModelInfer", request([1, 16], 64, "FP32")) == grpc.StatusCode.INVALID_ARGUMENT  # datatype
    assert raw("ModelInfer", request([1, 16], 64, "NOPE")) == grpc.StatusCode.INVALID_ARGUMENT
    value = np.ones((1, 16), dtype=np.int32)
    assert np.array_equal(
        client.infer("simple", simple_inputs("grpc", value, value)).as_numpy("OUTPUT0"), value * 2
    )
    assert server.alive() and client.is_server_ready()


def test_admin_rpcs_from_loopback_with_token_set(server_factory: ServerFactory, tmp_path: Path) -> None:
    # loopback peers never need the token; admin RPCs are allowed to them
    server = server_factory(build_repository(tmp_path), env={"EDGESERVE_GRPC_TOKEN": "s3cret"})
    client = grpc_client(server)
    assert client.is_server_live()
    client.unregister_system_shared_memory()
    client.update_log_settings({"log_info": True})
    client.close()


def test_shared_memory_key_prefix_restriction(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = server_factory(
        build_repository(tmp_path), env={"EDGESERVE_SHM_KEY_PREFIXES": "edgeserve_allowed_"}
    )
    client = grpc_client(server)
    suffix = uuid.uuid4().hex[:10]
    allowed = shm.create_shared_memory_region("ok", f"/edgeserve_allowed_{suffix}", 64)
    other = shm.create_shared_memory_region("no", f"/edgeserve_other_{suffix}", 64)
    try:
        client.register_system_shared_memory("ok", f"/edgeserve_allowed_{suffix}", 64)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("no", f"/edgeserve_other_{suffix}", 64)
        assert status_of(info) == "StatusCode.PERMISSION_DENIED"
        assert set(client.get_system_shared_memory_status().regions) == {"ok"}
        client.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(allowed)
        shm.destroy_shared_memory_region(other)
    client.close()
