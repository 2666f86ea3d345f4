"""HTTPS with client certificates ([http] tls_cert / tls_key / tls_client_ca), attacked from the network:
no certificate, a certificate from another CA, plain HTTP. gRPC with the same PKI for comparison."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer
from http_access_helpers import Pki, make_pki, network_address, start_probed
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)
X = np.ones((1, 16), dtype=np.float32)
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}]})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), [network_address()])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[RunningServer]:
    env = {}
    for section in ("HTTP", "GRPC"):
        env[f"EDGESERVE_{section}_TLS_CERT"] = str(pki.server_cert)
        env[f"EDGESERVE_{section}_TLS_KEY"] = str(pki.server_key)
        env[f"EDGESERVE_{section}_TLS_CLIENT_CA"] = str(pki.ca)

    def ready(candidate: RunningServer) -> bool:
        try:
            url = f"https://127.0.0.1:{candidate.http_port}/v2/health/ready"
            return requests.get(
                url, verify=str(pki.ca), cert=(str(pki.client_cert), str(pki.client_key)), timeout=2
            ).ok
        except requests.RequestException:
            return False

    running = start_probed(tmp_path_factory.mktemp("tls"), ready, ["--host", "0.0.0.0"], env)
    yield running
    running.stop()


def url(server: RunningServer, path: str) -> str:
    return f"https://{network_address()}:{server.http_port}{path}"


def successes(server: RunningServer, pki: Pki) -> int:
    stats = requests.get(
        url(server, "/v2/models/mlp/stats"),
        verify=str(pki.ca),
        cert=(str(pki.client_cert), str(pki.client_key)),
        timeout=30,
    ).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def test_a_client_with_a_certificate_from_the_ca_is_served(server: RunningServer, pki: Pki) -> None:
    before = successes(server, pki)
    response = requests.post(
        url(server, "/v2/models/mlp/infer"),
        data=BODY,
        verify=str(pki.ca),
        cert=(str(pki.client_cert), str(pki.client_key)),
        timeout=30,
    )
    assert response.status_code == 200, response.text
    client = httpclient.InferenceServerClient(
        f"{network_address()}:{server.http_port}",
        ssl=True,
        ssl_options={
            "ca_certs": str(pki.ca),
            "certfile": str(pki.client_cert),
            "keyfile": str(pki.client_key),
        },
    )
    tensor = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(X)
    assert client.infer("mlp", [tensor]).as_numpy("OUTPUT0").shape == (1, 4)
    client.close()
    assert successes(server, pki) == before + 2
    assert "listening on https://0.0.0.0" in server.log()


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_a_client_without_a_trusted_certificate_is_refused_in_the_handshake(
    server: RunningServer, pki: Pki, who: str
) -> None:
    before = successes(server, pki)
    cert = None if who == "no certificate" else (str(pki.rogue_cert), str(pki.rogue_key))
    with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
        requests.post(
            url(server, "/v2/models/mlp/infer"), data=BODY, verify=str(pki.ca), cert=cert, timeout=30
        )
    assert successes(server, pki) == before
    assert server.alive()


def test_plain_http_on_the_tls_port_gets_no_answer(server: RunningServer, pki: Pki) -> None:
    before = successes(server, pki)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(
            f"http://{network_address()}:{server.http_port}/v2/models/mlp/infer", data=BODY, timeout=30
        )
    assert successes(server, pki) == before


def test_grpc_with_the_same_pki(server: RunningServer, pki: Pki) -> None:
    address = f"{network_address()}:{server.grpc_port}"
    trusted = grpcclient.InferenceServerClient(
        address, ssl=True, root_certificates=str(pki.ca), private_key=str(pki.client_key),
        certificate_chain=str(pki.client_cert),
    )  # fmt: skip
    assert trusted.is_server_live()
    trusted.close()
    anonymous = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(pki.ca))
    with pytest.raises(InferenceServerException):
        anonymous.is_server_live(client_timeout=10)
    anonymous.close()
