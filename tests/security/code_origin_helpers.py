"""Models and clients for tests/security/test_code_origin.py: a Python model that leaves a marker file
when any of its code runs, a good local Python model, ONNX models with external data, and one load
call over HTTP or gRPC that returns (status, message) instead of raising."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer
from onnx import TensorProto, helper, numpy_helper
from python_models import as_pbtxt, python_config
from tritonclient.utils import InferenceServerException

# Any import of the file (the server's auto-complete worker or a model worker) writes the marker.
EVIL = """
import pathlib

pathlib.Path({marker!r}).write_text("the code ran")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return auto_complete_model_config

    def execute(self, requests):
        return []
"""

GOOD = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)]
            )
            for r in requests
        ]
"""

PY_CONFIG = python_config(("IN", "TYPE_FP32", [4]), ("OUT", "TYPE_FP32", [4]))
PY_PBTXT = as_pbtxt(PY_CONFIG)


def py_config(**changes: Any) -> str:
    """The good Python model's config as load-API JSON, with `changes` applied."""
    return json.dumps({**PY_CONFIG, **changes})


def evil_source(marker: Path) -> str:
    return EVIL.format(marker=str(marker))


def build_external_add(path: Path, location: str, data: Path | None = None) -> Path:
    """Y = X + W (FP32 [4]) whose W is external data at `location` (written to `data` when given)."""
    weights = np.arange(4, dtype=np.float32)
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), "W")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(weights.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"])],
        "external_add",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])],
        [tensor],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    if data is not None:
        data.write_bytes(weights.tobytes())
    return path


def load(
    protocol: str, server: RunningServer, name: str, config: str | None = None,
    files: dict[str, bytes] | None = None,
) -> tuple[str, str]:  # fmt: skip
    """One repository load over `protocol` ("http" or "grpc"): ("OK", "") or the error's status name
    (PERMISSION_DENIED, INVALID_ARG, ...) and message."""
    keyed = {f"file:{k}": v for k, v in (files or {}).items()} or None
    client: Any = (
        httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        if protocol == "http"
        else grpcclient.InferenceServerClient(server.grpc_url)
    )
    try:
        client.load_model(name, config=config, files=keyed)
    except InferenceServerException as exc:
        return _status_name(str(exc.status())), str(exc.message())
    finally:
        client.close()
    return "OK", ""


_HTTP_NAMES = {"400": "INVALID_ARG", "403": "PERMISSION_DENIED", "404": "NOT_FOUND", "500": "INTERNAL"}


def _status_name(status: str) -> str:
    if status.startswith("StatusCode."):
        name = status[len("StatusCode.") :]
        return "INVALID_ARG" if name == "INVALID_ARGUMENT" else name
    return _HTTP_NAMES.get(status, status)


def infer(protocol: str, server: RunningServer, name: str, tensors: tuple[str, str]) -> list[float]:
    """The model's answer to [0, 1, 2, 3] FP32 on input tensors[0], output tensors[1]."""
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        tensor = module.InferInput(tensors[0], [4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
        return [float(v) for v in client.infer(name, [tensor]).as_numpy(tensors[1])]
    finally:
        client.close()
