"""Attacks on the HTTP (and gRPC) API from the network, against a real server on every interface with
`[http] token` / `[grpc] token` set and admin endpoints loopback-only (the default).

The attacker is a real network peer: the tests connect to a non-loopback address of this box, so the
server sees a peer outside 127.0.0.0/8. Each refusal is checked on the wire (status, message) and for
what it left behind (model still loaded, no shared-memory region, log settings, inference count).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer
from http_access_helpers import TOKEN, network_address, start_exposed
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm

pytestmark = pytest.mark.timeout(300)
BEARER = {"Authorization": f"Bearer {TOKEN}"}
X = np.arange(16, dtype=np.float32).reshape(1, 16) / 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    network_address()  # skip early on a box without one
    tmp = tmp_path_factory.mktemp("http-access")
    running = start_exposed(tmp, env={"EDGESERVE_HTTP_TOKEN": TOKEN, "EDGESERVE_GRPC_TOKEN": TOKEN})
    yield running
    running.stop()


def remote(server: RunningServer) -> str:
    return f"http://{network_address()}:{server.http_port}"


def infer_body() -> bytes:
    inputs = [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": X.reshape(-1).tolist()}]
    return json.dumps({"inputs": inputs}).encode()


def successes(server: RunningServer) -> int:
    stats = requests.get(f"{server.base}/v2/models/mlp/stats", timeout=30).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def snapshot(server: RunningServer) -> dict[str, Any]:
    """What an attack could change, read from loopback (no token needed there)."""
    return {
        "ready": requests.get(f"{server.base}/v2/models/mlp/ready", timeout=30).status_code,
        "shm": requests.get(f"{server.base}/v2/systemsharedmemory/status", timeout=30).json(),
        "logging": requests.get(f"{server.base}/v2/logging", timeout=30).json(),
        "inferences": successes(server),
    }


# (method, path, body): everything a remote attacker would try first
ATTACKS: list[tuple[str, str, bytes]] = [
    ("POST", "/v2/models/mlp/infer", infer_body()),
    ("POST", "/v2/repository/models/mlp/unload", b"{}"),
    ("POST", "/v2/repository/models/evil/load", b'{"parameters": {"config": "{}"}}'),
    (
        "POST",
        "/v2/systemsharedmemory/region/evil/register",
        b'{"key": "/evil", "offset": 0, "byte_size": 64}',
    ),
    ("POST", "/v2/systemsharedmemory/unregister", b""),
    ("POST", "/v2/logging", b'{"log_verbose_level": 1, "log_info": false}'),
    ("GET", "/v2", b""),
    ("GET", "/v2/models/mlp/config", b""),
    ("POST", "/v2/repository/index", b"{}"),
    ("GET", "/metrics", b""),
    ("GET", "/no/such/path", b""),
]


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer", "Bearer \u00ff\u00fe"],
)
def test_network_peer_without_the_token_gets_401_and_changes_nothing(
    server: RunningServer, authorization: str | None
) -> None:
    before = snapshot(server)
    headers = {"Authorization": authorization} if authorization else {}
    for method, path, body in ATTACKS:
        response = requests.request(method, remote(server) + path, data=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "bearer token" in response.json()["error"] and "[http] token" in response.json()["error"]
    assert snapshot(server) == before
    assert server.alive()


def test_network_peer_with_the_token_infers_but_cannot_administer(server: RunningServer) -> None:
    before = snapshot(server)
    response = requests.post(
        remote(server) + "/v2/models/mlp/infer", data=infer_body(), headers=BEARER, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [1, 4]
    # tritonclient.http with the header, as a Triton app would send it
    client = httpclient.InferenceServerClient(f"{network_address()}:{server.http_port}")
    tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(X)
    assert client.infer("mlp", [tensor], headers=dict(BEARER)).as_numpy("OUTPUT0").shape == (1, 4)
    with pytest.raises(InferenceServerException, match="bearer token"):
        client.infer("mlp", [tensor])
    client.close()
    for method, path, body in ATTACKS[1:6]:  # the admin ones
        refused = requests.request(method, remote(server) + path, data=body, headers=BEARER, timeout=30)
        assert refused.status_code == 403, (path, refused.text)
        message = refused.json()["error"]
        assert (
            "only from the appliance itself (loopback)" in message and "[http] admin_loopback_only" in message
        )
    assert (
        requests.get(remote(server) + "/v2/logging", headers=BEARER, timeout=30).status_code == 200
    )  # reading
    after = snapshot(server)
    assert after["inferences"] == before["inferences"] + 2
    assert {k: v for k, v in after.items() if k != "inferences"} == {
        k: v for k, v in before.items() if k != "inferences"
    }


def test_health_probes_answer_without_the_token_and_say_nothing_else(server: RunningServer) -> None:
    for path in ("/v2/health/live", "/v2/health/ready"):
        response = requests.get(remote(server) + path, timeout=30)
        assert response.status_code == 200 and response.content == b""
    # model readiness names models: it needs the token
    assert requests.get(remote(server) + "/v2/models/mlp/ready", timeout=30).status_code == 401
    assert (
        requests.get(remote(server) + "/v2/models/mlp/ready", headers=BEARER, timeout=30).status_code == 200
    )


def test_loopback_peers_need_no_token_and_may_administer(server: RunningServer) -> None:
    local = server.base
    assert requests.post(local + "/v2/models/mlp/infer", data=infer_body(), timeout=30).status_code == 200
    region = shm.create_shared_memory_region("access_test", "/edgeserve_access_test", 64)
    try:
        body: dict[str, Any] = {"key": "/edgeserve_access_test", "offset": 0, "byte_size": 64}
        registered = requests.post(
            local + "/v2/systemsharedmemory/region/access_test/register", json=body, timeout=30
        )
        assert registered.status_code == 200, registered.text
        assert [
            r["name"] for r in requests.get(local + "/v2/systemsharedmemory/status", timeout=30).json()
        ] == ["access_test"]
        assert requests.post(local + "/v2/systemsharedmemory/unregister", timeout=30).status_code == 200
    finally:
        shm.destroy_shared_memory_region(region)
    level = requests.get(local + "/v2/logging", timeout=30).json()["log_verbose_level"]
    updated = requests.post(local + "/v2/logging", json={"log_verbose_level": level}, timeout=30)
    assert updated.status_code == 200, updated.text
    assert requests.post(local + "/v2/repository/models/mlp/unload", timeout=60).status_code == 200
    assert requests.get(local + "/v2/models/mlp/ready", timeout=30).status_code == 400
    assert requests.post(local + "/v2/repository/models/mlp/load", timeout=120).status_code == 200
    assert requests.get(local + "/v2/models/mlp/ready", timeout=30).status_code == 200


# -- the same over gRPC, from the network ---------------------------------------------------------------
def grpc_status(info: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(info.value.status())


def test_grpc_network_peer_needs_the_token_and_never_administers(server: RunningServer) -> None:
    before = snapshot(server)
    client = grpcclient.InferenceServerClient(f"{network_address()}:{server.grpc_port}")
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(X)
    token = {"authorization": f"Bearer {TOKEN}"}
    try:
        assert client.is_server_live() and client.is_server_ready()  # probes stay open
        attempts: list[Callable[[dict[str, str] | None], Any]] = [
            lambda headers: client.infer("mlp", [tensor], headers=headers),
            lambda headers: client.unload_model("mlp", headers=headers),
            lambda headers: client.load_model("evil", config="{}", headers=headers),
            lambda headers: client.register_system_shared_memory("evil", "/evil", 64, headers=headers),
            lambda headers: client.unregister_system_shared_memory(headers=headers),
            lambda headers: client.update_log_settings({"log_verbose_level": 1}, headers=headers),
            lambda headers: client.get_model_metadata("mlp", headers=headers),
        ]
        for attempt in attempts:
            with pytest.raises(InferenceServerException, match="bearer token") as info:
                attempt(None)
            assert grpc_status(info) == "StatusCode.UNAUTHENTICATED"
        assert client.infer("mlp", [tensor], headers=token).as_numpy("OUTPUT0").shape == (1, 4)
        for attempt in attempts[1:6]:
            with pytest.raises(InferenceServerException, match="only from the appliance itself") as info:
                attempt(token)
            assert grpc_status(info) == "StatusCode.PERMISSION_DENIED"
        # a stream without the token is refused before it reads a request
        errors: list[Any] = []
        client.start_stream(callback=lambda result, error: errors.append(error))
        with contextlib.suppress(InferenceServerException):  # the server may have ended the stream already
            client.async_stream_infer("mlp", [tensor])
        client.stop_stream()
        assert errors and "bearer token" in str(errors[0])
    finally:
        client.close()
    after = snapshot(server)
    assert after["inferences"] == before["inferences"] + 1
    assert after["shm"] == before["shm"] and after["logging"] == before["logging"] and after["ready"] == 200


def test_grpc_health_service_stays_open(server: RunningServer) -> None:
    pytest.importorskip("grpc_health")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{network_address()}:{server.grpc_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_listener_warns_about_what_it_leaves_open(server: RunningServer) -> None:
    log = server.log()
    # a token but no TLS: it says the token travels in clear text, on both listeners
    for section in ("http", "grpc"):
        assert f"[{section}] host = '0.0.0.0' listens beyond loopback without TLS" in log


def test_no_token_leaks_into_the_log(server: RunningServer) -> None:
    requests.get(remote(server) + "/v2", headers={"Authorization": "Bearer guess-1"}, timeout=30)
    assert TOKEN not in server.log() and "guess-1" not in server.log()
