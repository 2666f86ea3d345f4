"""Triton's restricted APIs, end to end: a real server started with Triton's own flags
(`--http-restricted-api`, `--grpc-restricted-protocol`), called from loopback, where the token would not
apply but a restricted category still needs its header. Answers as Triton's: HTTP 403 and gRPC
UNAVAILABLE with "This API/protocol is restricted, expecting header '<key>'"."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server, wait_until
from http_access_helpers import FAST, model_repository
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)
ADMIN = {"admin-key": "admin-value"}
INFER = {"infer-key": "infer-value"}
GRPC_ADMIN = {"triton-grpc-protocol-admin-key": "admin-value"}
GRPC_INFER = {"triton-grpc-protocol-infer-key": "infer-value"}
X = np.ones((1, 16), dtype=np.float32)
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]})
FLAGS = [
    "--http-restricted-api=model-repository,shared-memory,logging:admin-key=admin-value",
    "--http-restricted-api=inference:infer-key=infer-value",
    "--grpc-restricted-protocol=model-repository,shared-memory:admin-key=admin-value",
    "--grpc-restricted-protocol", "inference,health:infer-key=infer-value",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("restricted")
    running = start_server(model_repository(tmp), tmp, args=FLAGS, env=FAST)  # on loopback
    yield running
    running.stop()


def http_infer(server: RunningServer, headers: dict[str, str]) -> requests.Response:
    return requests.post(f"{server.base}/v2/models/mlp/infer", data=BODY, headers=headers, timeout=30)


def successes(server: RunningServer) -> int:
    stats = requests.get(f"{server.base}/v2/models/mlp/stats", timeout=30).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"infer-key": "wrong"},
        {"infer-key": "infer-valu"},
        ADMIN,
        {"triton-grpc-protocol-infer-key": "infer-value"},
    ],
)
def test_http_inference_without_its_header_is_refused_even_from_loopback(
    server: RunningServer, headers: dict[str, str]
) -> None:
    before = successes(server)
    response = http_infer(server, headers)
    assert response.status_code == 403
    assert response.json() == {"error": "This API is restricted, expecting header 'infer-key'"}
    assert successes(server) == before


def test_http_inference_with_its_header_is_served(server: RunningServer) -> None:
    assert http_infer(server, INFER).status_code == 200
    assert http_infer(server, {"INFER-KEY": "infer-value"}).status_code == 200  # header names: any case
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(X)
    assert client.infer("mlp", [tensor], headers=dict(INFER)).as_numpy("OUTPUT0").shape == (1, 4)
    with pytest.raises(
        InferenceServerException, match="This API is restricted, expecting header 'infer-key'"
    ):
        client.infer("mlp", [tensor])
    client.close()


def test_http_admin_groups_need_their_own_header(server: RunningServer) -> None:
    base = server.base
    for headers in ({}, INFER, {"admin-key": "admin-valuE"}):
        unload = requests.post(f"{base}/v2/repository/models/mlp/unload", headers=headers, timeout=30)
        assert unload.status_code == 403 and "expecting header 'admin-key'" in unload.json()["error"]
        shm_body: dict[str, Any] = {"key": "/r", "byte_size": 8}
        register = requests.post(
            f"{base}/v2/systemsharedmemory/region/r/register", json=shm_body, headers=headers, timeout=30
        )
        assert register.status_code == 403
        logging = requests.post(
            f"{base}/v2/logging", json={"log_verbose_level": 1}, headers=headers, timeout=30
        )
        assert logging.status_code == 403
    assert requests.get(f"{base}/v2/models/mlp/ready", timeout=30).status_code == 200  # still loaded
    assert requests.get(f"{base}/v2/systemsharedmemory/status", headers=ADMIN, timeout=30).json() == []
    # unrestricted categories stay open; the right header lets the admin call through
    assert requests.get(f"{base}/v2", timeout=30).status_code == 200
    assert requests.get(f"{base}/v2/models/mlp/config", timeout=30).status_code == 200
    assert (
        requests.post(f"{base}/v2/repository/models/mlp/unload", headers=ADMIN, timeout=60).status_code == 200
    )
    assert (
        requests.post(f"{base}/v2/repository/models/mlp/load", headers=ADMIN, timeout=120).status_code == 200
    )
    assert requests.get(f"{base}/v2/models/mlp/ready", timeout=30).status_code == 200


def grpc_error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_grpc_restricted_protocols(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(X)
    before = successes(server)
    try:
        expected = "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
        for call in (
            lambda: client.infer("mlp", [tensor]),
            lambda: client.infer("mlp", [tensor], headers={"triton-grpc-protocol-infer-key": "nope"}),
            lambda: client.infer("mlp", [tensor], headers=INFER),  # the HTTP form is not the gRPC one
            lambda: client.is_server_live(),
            lambda: client.is_model_ready("mlp"),
        ):
            error = grpc_error(call)
            assert str(error.status()) == "StatusCode.UNAVAILABLE" and error.message() == expected
        assert successes(server) == before
        assert client.infer("mlp", [tensor], headers=GRPC_INFER).as_numpy("OUTPUT0").shape == (1, 4)
        assert client.is_server_live(headers=GRPC_INFER)
        unload = grpc_error(lambda: client.unload_model("mlp", headers=GRPC_INFER))
        assert "expecting header 'triton-grpc-protocol-admin-key'" in unload.message()
        assert client.is_model_ready("mlp", headers=GRPC_INFER)
        assert client.get_inference_statistics("mlp")  # statistics: not restricted here
        errors: list[Any] = []
        client.start_stream(callback=lambda result, error: errors.append(error))
        with contextlib.suppress(InferenceServerException):  # the server may have ended the stream already
            client.async_stream_infer("mlp", [tensor])
        client.stop_stream()
        assert errors and expected in str(errors[0])
        client.start_stream(callback=lambda result, error: errors.append(error or result), headers=GRPC_INFER)
        client.async_stream_infer("mlp", [tensor])
        client.stop_stream()
        assert errors[-1].as_numpy("OUTPUT0").shape == (1, 4)
    finally:
        client.close()


def test_grpc_health_service_is_in_the_health_category(server: RunningServer) -> None:
    pytest.importorskip("grpc_health")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        metadata = tuple(GRPC_INFER.items())
        answer = stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_supervisor_is_not_locked_out_by_restricted_apis(tmp_path: Path) -> None:
    """`edgeserve run` hands the flags to its server; the supervisor still reads the repository and
    the model configs over its private control socket, without Triton's header."""
    flag = "--http-restricted-api=model-repository,model-config,statistics:admin-key=admin-value"
    running = start_server(model_repository(tmp_path), tmp_path, command="run", args=[flag], env=FAST)
    try:
        assert wait_until(lambda: "serving: mlp on onnxruntime" in running.log(), 60), running.log()
        refused = requests.post(f"{running.base}/v2/repository/index", json={}, timeout=30)
        assert refused.status_code == 403  # the server the supervisor started enforces the flag
    finally:
        running.stop()
