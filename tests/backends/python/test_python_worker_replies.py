"""Replies from a Python model's worker are matched to their call: a reply that is not the answer to
the call in flight (a worker whose control channel got out of step) is never handed to any request;
the call fails with INTERNAL, the worker is replaced, and later calls get their own answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pymodels import write_model

from edgeserve.backends.base import BackendOptions
from edgeserve.backends.python.backend import PythonBackend
from edgeserve.backends.python.instance import PythonInstance
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_pbtxt

pytestmark = pytest.mark.timeout(120)

# On X == 7 the model puts a reply frame of its own on the control channel ahead of the real one (as a
# worker out of step would): it names the request's own input (offset 0 of the shared memory) as Y.
OUT_OF_STEP = """
import json
import os
import struct
import time

import triton_python_backend_utils as pb_utils


def _control_fd():
    args = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    return int(args[args.index(b"--control-fd") + 1])


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] == 7:
                header = {"n": "Y", "t": "FP32", "s": [1], "o": 0, "b": 4}
                body = json.dumps({"responses": [{"outputs": [header]}]}).encode()
                os.write(_control_fd(), struct.pack("<I", len(body)) + body)
                time.sleep(0.5)  # the server reads this frame alone
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
"""

CONFIG = """
name: "out_of_step"
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[PythonInstance]:
    path = write_model(tmp_path / "repo", "out_of_step", OUT_OF_STEP, CONFIG)
    made = PythonBackend().load(path, parse_pbtxt(path.parent.parent / "config.pbtxt"), BackendOptions())
    yield made
    made.close()


def _y(instance: PythonInstance, x: float) -> float:
    return float(instance.infer({"X": np.array([x], np.float32)})["Y"][0])


def test_a_reply_that_is_not_the_calls_answer_reaches_no_request(instance: PythonInstance) -> None:
    assert _y(instance, 1.0) == 2.0
    first = instance.pid
    with pytest.raises(InferenceError) as err:
        _y(instance, 7.0)  # before: answered 7.0 (the frame), and the next call got this one's 14.0
    assert err.value.status is Status.INTERNAL
    assert "answered call None instead of 2; restarting it" in err.value.message
    assert _y(instance, 3.0) == 6.0  # its own answer, from a new worker
    assert _y(instance, 4.0) == 8.0
    assert instance.pid != first and instance.restarts == 1
