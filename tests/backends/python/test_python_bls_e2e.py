"""BLS, decoupled streaming, custom metrics and a folder with only 1/model.py: Python models behind
a real `edgeserve serve`, driven by tritonclient as a Triton user would: a BLS model calling add_sub
(sync, and async with two calls in flight), a BLS call with a wrong dtype (INVALID_ARG to the
caller), a model calling itself with its only instance (an error, not a deadlock), a decoupled
model's responses over a gRPC stream, a BLS call into a decoupled model (an iterator of responses)
and the custom counter it keeps on /metrics."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, scrape, start_server
from pymodels import AUTO, write_model
from streammodels import (
    BLS_ASYNC,
    BLS_CONFIG,
    BLS_DECOUPLED,
    BLS_DECOUPLED_CONFIG,
    BLS_SYNC,
    DECOUPLED_CONFIG,
    REPEAT,
)
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)
WAIT_S = 60.0  # generous: nothing here measures speed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("bls")
    repo = tmp / "repo"
    write_model(repo, "add_sub")
    write_model(repo, "bls_sync", BLS_SYNC, BLS_CONFIG.format(name="bls_sync"))
    write_model(repo, "bls_async", BLS_ASYNC, BLS_CONFIG.format(name="bls_async"))
    write_model(repo, "repeat", REPEAT, DECOUPLED_CONFIG.format(name="repeat"))
    write_model(repo, "bls_decoupled", BLS_DECOUPLED, BLS_DECOUPLED_CONFIG)
    (repo / "auto_only" / "1").mkdir(parents=True)  # no config.pbtxt: model.py's auto_complete_config
    (repo / "auto_only" / "1" / "model.py").write_text(AUTO)
    running = start_server(repo, tmp)
    yield running
    running.stop()


def _add_sub_inputs(dtype: str = "FP32") -> tuple[list[httpclient.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.full((1, 4), 0.5, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 4], dtype), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


@pytest.mark.parametrize("model", ["bls_sync", "bls_async"])
def test_a_bls_model_calls_add_sub(server: RunningServer, model: str) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    inputs, a, b = _add_sub_inputs()
    result = client.infer(model, inputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)


def test_a_bls_call_with_a_wrong_dtype_gets_invalid_arg(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    inputs, _, _ = _add_sub_inputs()
    with pytest.raises(InferenceServerException) as raised:
        client.infer("bls_sync", inputs, parameters={"cast": True})
    assert "3: " in str(raised.value)  # TritonError.INVALID_ARG, as the model saw it
    assert "INPUT0" in str(raised.value)


def test_a_bls_model_calling_itself_gets_an_error_not_a_deadlock(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=WAIT_S)
    inputs, _, _ = _add_sub_inputs()
    with pytest.raises(InferenceServerException) as raised:
        client.infer("bls_sync", inputs, parameters={"target": "bls_sync"})
    assert "itself" in str(raised.value)
    # and the model still serves
    result = client.infer("bls_sync", _add_sub_inputs()[0])
    assert result.as_numpy("OUTPUT0") is not None


def test_a_decoupled_model_streams_its_responses_over_grpc(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        values = np.array([4, 2, 0, 1], dtype=np.int32)
        tensor = grpcclient.InferInput("IN", [4], "INT32")
        tensor.set_data_from_numpy(values)
        client.async_stream_infer("repeat", [tensor], enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=WAIT_S)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                got.append(int(result.as_numpy("OUT")[0]))
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    assert got == [4, 2, 0, 1]


def test_bls_into_a_decoupled_model_and_a_custom_counter(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    tensor = httpclient.InferInput("IN", [4], "INT32")
    tensor.set_data_from_numpy(np.array([4, 2, 0, 1], dtype=np.int32))
    result = client.infer("bls_decoupled", [tensor])
    assert int(result.as_numpy("SUM")[0]) == 7 and int(result.as_numpy("COUNT")[0]) == 4
    series = scrape(server.base, "bls_calls")
    assert series.get('bls_calls{target="repeat"}', 0) >= 1, series


def test_a_folder_with_only_model_py_is_an_auto_completed_python_model(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    assert client.is_model_ready("auto_only")
    config = client.get_model_config("auto_only")
    assert config["backend"] == "python" and [i["name"] for i in config["input"]] == ["IN"]
