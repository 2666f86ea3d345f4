"""What Triton's python_backend examples rely on, that scripts/triton_examples.sh found missing, behind a
real `edgeserve serve` with tritonclient. The models are ours, written in the examples' patterns:
- bls: the target model's name comes in as a BYTES input and goes to InferenceRequest as bytes;
- bls_decoupled (sync): the sum of a decoupled model's responses kept in `np.array([0])` (INT64) for
  an INT32 output: taken, as Triton does, and cast to the config's type as every backend's outputs;
- bls_decoupled (async): `await async_exec(decoupled=True)` gives an iterator a plain `for` walks
  (and `async for` too), two of them in flight at once under asyncio.gather."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from es_server import RunningServer, start_server
from pymodels import write_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)

# Decoupled: IN[0] responses, each OUT = IN[0]^2, then the final flag alone.
SQUARE_CONFIG = """
name: "square"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
SQUARE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for _ in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n * n], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# add_sub as Triton's example has it: no batching, [4] tensors
ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""

ROUTER_CONFIG = """
name: "router"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""
# The name as the BYTES input gives it (bytes), handed to InferenceRequest unchanged.
ROUTER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0]
            inputs = [pb_utils.get_input_tensor_by_name(request, n) for n in ("INPUT0", "INPUT1")]
            result = pb_utils.InferenceRequest(model_name=target, inputs=inputs,
                                               requested_output_names=["OUTPUT0", "OUTPUT1"]).exec()
            if result.has_error():
                raise pb_utils.TritonModelException(result.error().message())
            responses.append(pb_utils.InferenceResponse(result.output_tensors()))
        return responses
"""

SUM_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
# The sum starts as np.array([0]): INT64 for the INT32 output.
SUM_SYNC = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(model_name="square", requested_output_names=["OUT"],
                                         inputs=[pb_utils.get_input_tensor_by_name(requests[0], "IN")])
        total = np.array([0])
        for response in call.exec(decoupled=True):
            if response.output_tensors():
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)])]
"""
# Two decoupled calls in flight (gather); the first walked with `for`, the second with `async for`.
SUM_ASYNC = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        count = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        calls = [pb_utils.InferenceRequest(model_name="square", requested_output_names=["OUT"],
                                           inputs=[count]).async_exec(decoupled=True) for _ in range(2)]
        first, second = await asyncio.gather(*calls)
        total = np.array([0], np.int32)
        for response in first:
            if response.output_tensors():
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        async for response in second:
            if response.output_tensors():
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)])]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("patterns")
    repo = tmp / "repo"
    write_model(repo, "add_sub", None, ADD_SUB_CONFIG)
    write_model(repo, "square", SQUARE, SQUARE_CONFIG)
    write_model(repo, "router", ROUTER, ROUTER_CONFIG)
    write_model(repo, "sum_sync", SUM_SYNC, SUM_CONFIG.format(name="sum_sync"))
    write_model(repo, "sum_async", SUM_ASYNC, SUM_CONFIG.format(name="sum_async"))
    running = start_server(repo, tmp)
    yield running
    running.stop()


def _client(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=120.0)


def _routed(target: str) -> tuple[list[httpclient.InferInput], np.ndarray, np.ndarray]:
    a, b = np.arange(4, dtype=np.float32), np.full(4, 0.25, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32"),
              httpclient.InferInput("TARGET", [1], "BYTES")]  # fmt: skip
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    inputs[2].set_data_from_numpy(np.array([target], dtype=np.object_))
    return inputs, a, b


def test_a_bls_call_takes_the_model_name_as_bytes(server: RunningServer) -> None:
    inputs, a, b = _routed("add_sub")
    result = _client(server).infer("router", inputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)


def test_a_bls_call_to_an_unknown_model_by_bytes_names_it(server: RunningServer) -> None:
    with pytest.raises(InferenceServerException) as raised:
        _client(server).infer("router", _routed("undefined_model")[0])
    assert "'undefined_model'" in str(raised.value)
    assert ": TritonModelException: " in str(raised.value)  # as Triton names it, not edgeserve's module


def _sum(server: RunningServer, model: str, n: int) -> np.ndarray:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
    answer: np.ndarray = _client(server).infer(model, [tensor]).as_numpy("SUM")
    return answer


def test_python_models_get_no_implicit_zero_data_warm_up(server: RunningServer) -> None:
    """As Triton, a Python model's execute runs at load only for a configured model_warmup: router's
    inputs have fixed dims (a zero-data warm-up could be built), but zeros would make it call a model
    named b"" at load; square is also decoupled (a unary warm-up call would be refused)."""
    log = server.log()
    for model in ("router", "square", "sum_sync"):
        assert f"{model}/config.pbtxt: implicit zero-data warm-up" not in log, model


@pytest.mark.parametrize("n", [4, 0, 1])
def test_an_int64_output_declared_int32_is_answered_cast(server: RunningServer, n: int) -> None:
    answer = _sum(server, "sum_sync", n)
    assert answer.dtype == np.int32 and answer.tolist() == [n * n * n]


@pytest.mark.parametrize("n", [4, 0, 1])
def test_awaited_decoupled_bls_calls_are_walked_with_for_and_async_for(server: RunningServer, n: int) -> None:
    answer = _sum(server, "sum_async", n)
    assert answer.dtype == np.int32 and answer.tolist() == [2 * n * n * n]
