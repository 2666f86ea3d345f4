"""A real decoupled Python model (our own model.py in the pattern of Triton's decoupled "repeat"
example: `request.get_response_sender()`, one response per element, the final flag alone) served by
`edgeserve serve` on loopback, streamed with tritonclient as Triton's example client does; and the
same model over HTTP /generate_stream. No stand-in: the Python backend's worker process runs it."""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from es_server import RunningServer, start_server

WAIT_S = 120.0  # generous: a worker process starts on a loaded 2-core box

REPEAT_PY = '''
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            thread = threading.Thread(target=self.repeat, args=(values, sender), daemon=True)
            thread.start()
            self.threads.append(thread)
        return None

    def repeat(self, values, sender):
        for index, value in enumerate(values):
            out = pb_utils.Tensor("OUT", np.array([value], np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], np.uint32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(10)
'''

CONFIG = """name: "repeat_py"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [{ name: "IN", data_type: TYPE_INT32, dims: [-1] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [1] }, { name: "IDX", data_type: TYPE_UINT32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("decoupled-python")
    model = tmp / "repo" / "repeat_py"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(REPEAT_PY)
    running = start_server(tmp / "repo", tmp, timeout=WAIT_S)
    yield running
    running.stop()


def test_a_python_decoupled_model_streams_over_grpc(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inp = grpcclient.InferInput("IN", [4], "INT32")
        inp.set_data_from_numpy(np.array([10, 11, 12, 13], dtype=np.int32))
        client.async_stream_infer("repeat_py", [inp], request_id="py", enable_empty_final_response=True)
        got = [results.get(timeout=WAIT_S) for _ in range(5)]
    finally:
        client.stop_stream()
        client.close()
    assert all(error is None for _, error in got), got
    assert [int(r.as_numpy("OUT")[0]) for r, _ in got[:4]] == [10, 11, 12, 13]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert finals == [False, False, False, False, True]


def test_a_python_decoupled_model_streams_over_generate_stream(server: RunningServer) -> None:
    body = json.dumps({"IN": [3, 2, 1]}).encode()
    request = urllib.request.Request(server.base + "/v2/models/repeat_py/generate_stream", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        raw = response.read().decode()
    events = [json.loads(chunk[len("data: ") :]) for chunk in raw.split("\n\n") if chunk.strip()]
    assert [e["OUT"] for e in events] == [3, 2, 1]
