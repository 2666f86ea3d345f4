"""A Python model is user code in its own worker process; the server must survive whatever that process
sends. A BLS call may name an input by reference into the worker's per-call region (callref.py)
instead of copying it: a model that forges those references (outside the region, negative, of the
wrong size, into a region it does not have, of the wrong type), as an attacker would by writing the
event channel's messages itself, gets INVALID_ARG for each, the called model never runs, and the
server keeps serving. The same model tries to shrink the shared-memory files under the server's
views (which would fault the server): the kernel refuses (the files are sealed). A real `edgeserve
serve`, driven over HTTP."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from es_server import RunningServer, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "python"))
from pymodels import write_model

pytestmark = pytest.mark.timeout(300)

FORGER = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from edgeserve.backends.python import pb_bls

GOOD = {"n": "INPUT0", "t": "FP32", "s": [1, 4], "o": 0, "b": 16, "r": "call"}
FORGED = [
    {"o": 1 << 40},                      # far past the region's end
    {"o": (1 << 20) - 8},                # straddling its end (the region is 1 MiB here)
    {"o": -64},                          # before its start
    {"o": 1 << 64, "b": 1 << 63},        # past any machine integer
    {"b": 1 << 40},                      # larger than the region
    {"b": 8},                            # fewer bytes than the shape needs
    {"r": "events"},                     # a region the worker does not have
    {"r": 5},
    {"o": "0"},                          # not integers
    {"o": True},
    {"t": "BYTES"},                      # BYTES are never passed by reference
    {"t": "NOPE"},
    {"s": [-1, 4]},                      # a negative dimension
]


class TritonPythonModel:
    def execute(self, requests):
        channel = pb_bls.find_link().channel
        answers = []
        for change in FORGED:
            headers, block = channel.write([("INPUT1", np.ones((1, 4), np.float32))])
            message = {"op": "bls", "model": "add_sub", "inputs": [{**GOOD, **change}, *headers],
                       "outputs": ["OUTPUT0"], "chain": "forger"}
            answer = channel.call(message, 60.0)
            channel.arena.free(block)
            answers.append([answer.get("status"), answer.get("error", "")])
        shrink = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if "edgeserve-py" in target:
                try:
                    os.ftruncate(int(fd), 4096)
                    shrink.append("shrunk")
                except OSError as exc:
                    shrink.append(exc.errno)
        report = json.dumps({"answers": answers, "shrink": shrink})
        out = pb_utils.Tensor("REPORT", np.array([report.encode()], np.object_))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""
FORGER_CONFIG = """
name: "forger"
backend: "python"
max_batch_size: 0
input { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }
output { name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("forged")
    repo = tmp / "repo"
    write_model(repo, "add_sub")
    write_model(repo, "forger", FORGER, FORGER_CONFIG)
    running = start_server(repo, tmp)
    yield running
    running.stop()


def _executions(server: RunningServer, model: str) -> int:
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=30) as response:
        stats: dict[str, Any] = json.load(response)
    return int(stats["model_stats"][0].get("execution_count", 0))


def _add_sub(client: httpclient.InferenceServerClient) -> np.ndarray:
    inputs = [httpclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    inputs[1].set_data_from_numpy(np.ones((1, 4), np.float32))
    return np.asarray(client.infer("add_sub", inputs).as_numpy("OUTPUT0"))


def test_forged_region_references_are_invalid_arg_and_nothing_runs(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=120)
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    report = json.loads(client.infer("forger", [tensor]).as_numpy("REPORT")[0])
    assert len(report["answers"]) == 13
    for status, error in report["answers"]:
        assert status == "INVALID_ARG", error
        assert "BLS input 'INPUT0'" in error  # names what was wrong, for the model's author
    assert _executions(server, "add_sub") == 0  # no forged call reached the model
    # Both shared-memory files (the per-call region and the event channel's, each open twice: the fd
    # passed and the one its mapping keeps) refused to shrink.
    assert len(report["shrink"]) >= 2 and set(report["shrink"]) == {1}, report["shrink"]  # EPERM
    # The server, the forger's worker and the called model all still work.
    np.testing.assert_array_equal(_add_sub(client), np.arange(4, dtype=np.float32).reshape(1, 4) + 1)
    assert _executions(server, "add_sub") == 1
    assert len(json.loads(client.infer("forger", [tensor]).as_numpy("REPORT")[0])["answers"]) == 13
    assert server.process.poll() is None
