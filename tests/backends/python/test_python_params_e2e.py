"""What a Python model learns about each request, behind a real `edgeserve serve`: its ID and custom
parameters (tritonclient's request_id / parameters over gRPC and HTTP), and that the response cache
keys on those parameters: the same input with another parameter value is computed again, never
answered from another request's entry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server
from pymodels import write_model

pytestmark = pytest.mark.timeout(180)

# Y = X * the request's "scale" parameter; ID and PARAMS echo request_id() and parameters().
ECHO = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            params = json.loads(request.parameters())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", (x * float(params.get("scale", 1))).astype(np.float32)),
                pb_utils.Tensor("ID", np.array([request.request_id().encode()], dtype=np.object_)),
                pb_utils.Tensor("PARAMS", np.array([request.parameters().encode()], dtype=np.object_)),
            ]))
        return responses
"""


def _config(name: str, cached: bool) -> str:
    return f"""
name: "{name}" backend: "python" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }},
         {{ name: "ID" data_type: TYPE_STRING dims: [ 1 ] }},
         {{ name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] }} ]
{"response_cache { enable: true }" if cached else ""}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("pyparams")
    repo = tmp / "repo"
    write_model(repo, "echo", ECHO, _config("echo", False))
    write_model(repo, "echo_cached", ECHO, _config("echo_cached", True))
    running = start_server(repo, tmp, env={"EDGESERVE_SERVER_CACHE_MB": "4"})
    yield running
    running.stop()


def _infer(module: Any, client: Any, model: str, x: float, **kwargs: Any) -> Any:
    tensor = module.InferInput("X", [1], "FP32")
    tensor.set_data_from_numpy(np.array([x], np.float32))
    return client.infer(model, [tensor], **kwargs)


@pytest.mark.parametrize("module", [grpcclient, httpclient], ids=["grpc", "http"])
def test_request_id_and_parameters_reach_the_model(server: RunningServer, module: Any) -> None:
    url = server.grpc_url if module is grpcclient else server.http_url
    client = module.InferenceServerClient(url)
    try:
        result = _infer(module, client, "echo", 2.0, request_id="req-7", parameters={"scale": 3, "tag": "a"})
    finally:
        client.close()
    assert float(result.as_numpy("Y")[0]) == 6.0
    assert result.as_numpy("ID")[0] == b"req-7"
    assert json.loads(result.as_numpy("PARAMS")[0]) == {"scale": 3, "tag": "a"}


def test_the_cache_keys_on_the_parameters(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        answers = [
            float(_infer(grpcclient, client, "echo_cached", 2.0, parameters=params).as_numpy("Y")[0])
            for params in ({"scale": 3}, {"scale": 5}, {"scale": 3}, {}, {"scale": "5"})
        ]
        stats = client.get_inference_statistics("echo_cached", as_json=True)["model_stats"][0]
    finally:
        client.close()
    assert answers == [6.0, 10.0, 6.0, 2.0, 10.0]  # before: 6.0 every time (the first entry)
    assert int(stats["inference_stats"]["cache_hit"]["count"]) == 1  # only the repeat of {"scale": 3}
