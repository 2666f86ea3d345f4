"""The gRPC frontend's unary RPCs, driven with tritonclient against the real DataPlane over fake models."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_fakes import Client, Inproc, InProcessServer, add_sub_inputs, make_plane
from tls_certs import self_signed
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from edgeserve.config import Settings
from edgeserve.frontends import access
from edgeserve.frontends.grpc.auth import (
    AccessPolicy,
    bearer_token,
    check,
    is_loopback_bind,
    is_loopback_peer,
)
from edgeserve.protocol.errors import InferenceError, Status


def status_of(exc: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(exc.value.status())


def test_health_and_metadata(client: Client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("simple", "7")
    meta = client.get_server_metadata()
    assert meta.name == "edgeserve" and meta.version.count(".") == 2
    for extension in ("model_repository", "system_shared_memory", "statistics", "model_configuration"):
        assert extension in meta.extensions
    assert "cuda_shared_memory" not in meta.extensions
    model = client.get_model_metadata("simple")
    assert model.name == "simple" and list(model.versions) == ["1"] and model.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    config = client.get_model_config("simple").config
    assert config.max_batch_size == 8 and config.input[0].name == "INPUT0"
    as_json = client.get_model_config("simple", as_json=True)
    assert as_json["config"]["max_batch_size"] == 8
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_config("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"


def test_infer_and_statistics_add_up(client: Client, inproc: Inproc) -> None:
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.ones((2, 16), dtype=np.int32)
    for i in range(5):
        result = client.infer("simple", add_sub_inputs(a, b), request_id=f"r{i}")
        assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
        assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
        response = result.get_response()
        assert response.id == f"r{i}" and response.model_version == "1" and response.model_name == "simple"
    only = client.infer("simple", add_sub_inputs(a, b), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert only.as_numpy("OUTPUT0") is None and np.array_equal(only.as_numpy("OUTPUT1"), a - b)
    with pytest.raises(InferenceServerException):
        client.infer("simple", add_sub_inputs(a, b[:1]))
    stats = client.get_inference_statistics("simple").model_stats
    assert len(stats) == 1 and stats[0].name == "simple" and stats[0].version == "1"
    inference = stats[0].inference_stats
    assert inference.success.count == 6 and inference.fail.count == 1
    assert stats[0].inference_count == 12 and stats[0].last_inference > 0
    every = client.get_inference_statistics(as_json=True)
    assert {m["name"] for m in every["model_stats"]} == {"simple", "sleep", "echo"}
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"


def test_async_infer_many_concurrent(client: Client) -> None:
    import queue

    done: queue.Queue[Any] = queue.Queue()
    values = [np.full((1, 16), i, dtype=np.int32) for i in range(64)]
    for i, value in enumerate(values):
        client.async_infer(
            "simple", add_sub_inputs(value, value), lambda result, error, i=i: done.put((i, result, error))
        )
    for _ in values:
        i, result, error = done.get(timeout=30)
        assert error is None
        assert np.array_equal(result.as_numpy("OUTPUT0"), values[i] * 2)


def test_bytes_infer(client: Client) -> None:
    text = np.array([b"hello", b"", "wörld".encode(), b"\x00\xff"], dtype=np.object_)
    tensor = grpcclient.InferInput("TEXT", [4], "BYTES")
    tensor.set_data_from_numpy(text)
    result = client.infer("echo", [tensor])
    assert result.as_numpy("ECHO").tolist() == text.tolist()


def test_priority_timeout_and_sequence_parameters_reach_the_scheduler(client: Client, inproc: Inproc) -> None:
    value = np.zeros((1, 16), dtype=np.int32)
    client.infer("simple", add_sub_inputs(value, value), priority=2, timeout=5000)
    job = inproc[1].models["simple"].scheduler.jobs[-1]
    assert job.priority == 2 and job.timeout_us == 5000
    client.infer("simple", add_sub_inputs(value, value), sequence_id=42, sequence_start=True)
    client.infer("simple", add_sub_inputs(value, value), sequence_id="cam-1", sequence_end=True)
    client.infer("simple", add_sub_inputs(value, value), parameters={"tag": "x", "n": 3, "f": 0.5, "b": True})


def test_repository_rpcs(client: Client, inproc: Inproc) -> None:
    repo = inproc[1]
    index = client.get_model_repository_index()
    assert {(m.name, m.version, m.state) for m in index.models} >= {("simple", "1", "READY")}
    config = json.dumps({"name": "new", "backend": "onnxruntime", "max_batch_size": 2})
    client.load_model("new", config=config, files={"file:1/model.onnx": b"onnx-bytes"})
    assert repo.loads[-1] == ("new", config, {"1/model.onnx": b"onnx-bytes"})
    client.load_model("simple")
    assert list(repo.loads[-1]) == ["simple", None, None]
    with pytest.raises(InferenceServerException) as info:
        client.load_model("new", files={"file:1/model.onnx": b"x"})  # files need a config
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("new", config=config, files={"file:../../etc/passwd": b"x"})
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("new", config="{not json")
    assert status_of(info) != "StatusCode.OK"
    client.unload_model("simple", unload_dependents=True)
    assert repo.unloads[-1] == ("simple", True)
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("nope")
    assert status_of(info) == "StatusCode.NOT_FOUND"


def test_repository_name_is_unsupported(inproc: Inproc) -> None:
    with grpc.insecure_channel(inproc[0].url) as channel:
        stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for call, request in (
            (stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(repository_name="other")),
            (
                stub.RepositoryModelLoad,
                service_pb2.RepositoryModelLoadRequest(repository_name="o", model_name="m"),
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_log_settings(client: Client, inproc: Inproc) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        settings = client.get_log_settings(as_json=True)["settings"]
        assert set(settings) >= {"log_info", "log_warning", "log_error", "log_verbose_level", "log_format"}
        updated = client.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
        assert updated["log_verbose_level"]["uint32_param"] == 1 and root.level == logging.DEBUG
        client.update_log_settings({"log_verbose_level": 0, "log_info": False, "log_warning": True})
        assert root.level == logging.WARNING
        with pytest.raises(InferenceServerException) as info:
            client.update_log_settings({"log_file": "/tmp/x.log"})
        assert status_of(info) == "StatusCode.UNIMPLEMENTED"
        request = service_pb2.LogSettingsRequest()
        request.settings["log_info"].uint32_param = 3  # a uint32 where a bool is expected
        with grpc.insecure_channel(inproc[0].url) as channel:
            stub = grpcclient.service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as rpc_info:
                stub.LogSettings(request)
            assert rpc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        root.setLevel(before)


def test_cuda_shared_memory_and_trace(client: Client) -> None:
    assert len(client.get_cuda_shared_memory_status().regions) == 0
    client.unregister_cuda_shared_memory()  # perf_analyzer calls this before using system shm
    with pytest.raises(InferenceServerException) as info:
        client.register_cuda_shared_memory("c", b"\0" * 64, 0, 1024)
    assert status_of(info) == "StatusCode.UNIMPLEMENTED" and "CUDA shared memory" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_cuda_shared_memory_status("c")
    assert status_of(info) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.get_trace_settings()
    assert status_of(info) == "StatusCode.UNIMPLEMENTED"


def test_health_service(inproc: Inproc) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(inproc[0].url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest()).status == serving
        named = health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")
        assert stub.Check(named).status == serving
        inproc[0].plane.live_flag = False
        assert stub.Check(named).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="other"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# -- bad input ---------------------------------------------------------------------------------------
def raw_call(url: str, method: str, payload: bytes) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        try:
            return bytes(call(payload, timeout=10))
        except grpc.RpcError as exc:
            return exc


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "SystemSharedMemoryRegister"])
@pytest.mark.parametrize("payload", [b"\x0a\xff\x01", b"\xff" * 12, b"\x3a\x80\x80\x80\x80\x08"])
def test_malformed_protobufs_get_internal_and_server_keeps_serving(
    inproc: Inproc, client: Client, method: str, payload: bytes
) -> None:
    error = raw_call(inproc[0].url, method, payload)
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.INTERNAL and "Unable to parse request" in (error.details() or "")
    assert client.is_server_live()


def test_bad_requests_get_their_status(client: Client, inproc: Inproc) -> None:
    def infer_status(msg: service_pb2.ModelInferRequest) -> grpc.StatusCode:
        result = raw_call(inproc[0].url, "ModelInfer", msg.SerializeToString())
        assert isinstance(result, grpc.RpcError), "request should have failed"
        return result.code()

    def request(model: str = "simple", shape: tuple[int, ...] = (1, 16), size: int = 64) -> Any:
        msg = service_pb2.ModelInferRequest(model_name=model)
        for name in ("INPUT0", "INPUT1"):
            msg.inputs.add(name=name, datatype="INT32", shape=shape)
            msg.raw_input_contents.append(b"\0" * size)
        return msg

    assert infer_status(request(model="nope")) == grpc.StatusCode.NOT_FOUND
    assert infer_status(request(size=60)) == grpc.StatusCode.INVALID_ARGUMENT  # wrong tensor size
    assert infer_status(request(shape=(2**40, 2**20))) == grpc.StatusCode.INVALID_ARGUMENT  # huge shape
    assert (
        infer_status(request(shape=(9, 16), size=9 * 64)) == grpc.StatusCode.INVALID_ARGUMENT
    )  # > max batch
    msg = request()
    msg.inputs[0].datatype = "FP32"
    assert infer_status(msg) == grpc.StatusCode.INVALID_ARGUMENT
    msg = request()
    msg.parameters["triton_x"].bool_param = True
    assert infer_status(msg) == grpc.StatusCode.INVALID_ARGUMENT
    msg = request()
    msg.outputs.add(name="NOPE")
    assert infer_status(msg) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.is_server_ready()


def test_four_k_frame_fits(tmp_path: Path) -> None:
    plane, repo = make_plane(tmp_path)
    repo.add(
        "frame",
        'max_batch_size: 1 input { name: "IMG" data_type: TYPE_UINT8 dims: [2160, 3840, 3] }'
        ' output { name: "SUM" data_type: TYPE_UINT64 dims: [1] }',
        lambda x: {"SUM": x["IMG"].reshape(1, -1).sum(1, dtype=np.uint64, keepdims=True)},
    )
    server = InProcessServer(plane)
    try:
        frame = np.random.default_rng(1).integers(0, 255, (1, 2160, 3840, 3), dtype=np.uint8)
        client = grpcclient.InferenceServerClient(server.url)
        tensor = grpcclient.InferInput("IMG", list(frame.shape), "UINT8")
        tensor.set_data_from_numpy(frame)
        result = client.infer("frame", [tensor])
        assert int(result.as_numpy("SUM")[0, 0]) == int(frame.sum(dtype=np.uint64))
        client.close()
    finally:
        server.close()
        repo.pool.shutdown(wait=False)


def test_port_in_use_is_an_error(inproc: Inproc) -> None:
    from edgeserve.frontends.grpc.server import GrpcFrontend

    settings = Settings()
    settings.grpc.port = inproc[0].frontend.port
    second = GrpcFrontend(inproc[0].plane, settings)
    with pytest.raises(OSError):
        inproc[0].call(second.start())


# -- access control ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.1.2.3:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/run/edgeserve.sock", True),
        ("ipv4:192.168.1.20:5000", False),
        ("ipv6:[fe80::1%eth0]:5000", False),
        ("ipv6:[::ffff:10.0.0.1]:5000", False),
        ("garbage", False),
    ],
)
def test_loopback_peers(peer: str, local: bool) -> None:
    assert is_loopback_peer(peer) is local


def test_loopback_binds() -> None:
    assert is_loopback_bind("127.0.0.1") and is_loopback_bind("::1") and is_loopback_bind("localhost")
    assert not is_loopback_bind("0.0.0.0") and not is_loopback_bind("192.168.1.2")


class FakeContext:
    def __init__(self, peer: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer = peer
        self._metadata = metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _denied(policy: AccessPolicy, context: FakeContext, admin: bool) -> Status | None:
    try:
        check(policy, context, access.MODEL_CONTROL if admin else access.INFERENCE)
    except InferenceError as exc:
        return exc.status
    return None


def test_access_policy() -> None:
    remote = "ipv4:192.168.1.20:5000"
    good = (("authorization", "Bearer s3cret"),)
    policy = AccessPolicy("grpc", token="s3cret", admin_loopback_only=True)
    assert _denied(policy, FakeContext("ipv4:127.0.0.1:1"), admin=True) is None
    assert _denied(policy, FakeContext(remote), admin=False) is Status.UNAUTHENTICATED
    assert (
        _denied(policy, FakeContext(remote, (("authorization", "Bearer nope"),)), False)
        is Status.UNAUTHENTICATED
    )
    assert _denied(policy, FakeContext(remote, good), admin=False) is None
    assert _denied(policy, FakeContext(remote, good), admin=True) is Status.PERMISSION_DENIED
    open_policy = AccessPolicy("grpc", token="", admin_loopback_only=False)
    assert _denied(open_policy, FakeContext(remote), admin=True) is None
    assert bearer_token((("authorization", "bearer abc "),)) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None


def test_guarded_handler_maps_policy_errors(tmp_path: Path) -> None:
    import asyncio

    from edgeserve.frontends.grpc.servicer import guarded

    aborted: list[tuple[grpc.StatusCode, str]] = []

    class AbortingContext(FakeContext):
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            aborted.append((code, details))

    async def handler(request: Any, context: Any) -> str:
        return "ok"

    call = guarded(handler, AccessPolicy("grpc", token="t"), access.INFERENCE)
    assert asyncio.run(call(None, AbortingContext("ipv4:127.0.0.1:9"))) == "ok"
    asyncio.run(call(None, AbortingContext("ipv4:10.1.1.1:9")))
    assert aborted[-1][0] == grpc.StatusCode.UNAUTHENTICATED


def test_tls(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path, "localhost", ["localhost"])
    settings = Settings()
    settings.grpc.tls_cert, settings.grpc.tls_key = cert, key
    plane, repo = make_plane(tmp_path)
    server = InProcessServer(plane, settings)
    try:
        client = grpcclient.InferenceServerClient(
            f"localhost:{server.frontend.port}", ssl=True, root_certificates=str(cert)
        )
        assert client.is_server_live()
        value = np.ones((1, 16), dtype=np.int32)
        assert np.array_equal(
            client.infer("simple", add_sub_inputs(value, value)).as_numpy("OUTPUT0"), value * 2
        )
        client.close()
        plain = grpcclient.InferenceServerClient(f"localhost:{server.frontend.port}")
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
        plain.close()
    finally:
        server.close()
        repo.pool.shutdown(wait=False)


def test_bf16_and_fp16_travel_raw(tmp_path: Path) -> None:
    import ml_dtypes

    plane, repo = make_plane(tmp_path)
    for name, config_type in (("bf16", "TYPE_BF16"), ("fp16", "TYPE_FP16")):
        repo.add(
            name,
            f'max_batch_size: 4 input {{ name: "X" data_type: {config_type} dims: [-1] }}'
            f' output {{ name: "Y" data_type: {config_type} dims: [-1] }}',
            lambda x: {"Y": x["X"] * 2},
        )
    server = InProcessServer(plane)
    try:
        client = grpcclient.InferenceServerClient(server.url)
        for name, datatype, dtype in (("bf16", "BF16", ml_dtypes.bfloat16), ("fp16", "FP16", np.float16)):
            x = np.array([[1.5, -2.0, 0.25]], dtype=dtype)
            tensor = grpcclient.InferInput("X", [1, 3], datatype)
            tensor.set_data_from_numpy(x)
            result = client.infer(name, [tensor])
            y = result.as_numpy("Y")
            assert y.dtype == np.dtype(dtype) and y.astype(np.float32).tolist() == [[3.0, -4.0, 0.5]]
            assert len(result.get_response().raw_output_contents[0]) == 6
        client.close()
    finally:
        server.close()
        repo.pool.shutdown(wait=False)
