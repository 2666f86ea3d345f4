"""Triton-style Python models for the tests (and the benchmark): sources, configs, a repository writer,
and a /proc scan for worker processes."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's python_backend examples/add_sub, as a user would write it.
ADD_SUB = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))
            inference_response = pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1])
            responses.append(inference_response)
        return responses

    def finalize(self):
        print("Cleaning up...")
"""

ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [{ kind: KIND_CPU, count: 1 }]
"""

# BYTES in, BYTES and INT32 out.
STRINGS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([t.upper() for t in text.reshape(-1)], dtype=np.object_).reshape(text.shape)
            length = np.array([len(t) for t in text.reshape(-1)], dtype=np.int32).reshape(text.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper),
                                                         pb_utils.Tensor("LENGTH", length)]))
        return responses
"""

STRINGS_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "LENGTH" data_type: TYPE_INT32 dims: [ -1 ] }
]
"""

# MODE picks a fault: 0 echo, 1 raise, 2 TritonError response, 3 os.abort(), 4 hang, 5 sys.exit(3).
FAULTY = """
import os
import sys
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().reshape(-1)[0])
            self.calls += 1
            if mode == 1:
                raise ValueError(f"mode 1 asks for an exception (call {self.calls})")
            if mode == 2:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("mode 2 refused")))
                continue
            if mode == 3:
                os.abort()
            if mode == 4:
                time.sleep(1000)
            if mode == 5:
                sys.exit(3)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
"""

FAULTY_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]
parameters { key: "hang_timeout_s" value: { string_value: "5" } }
"""
# 5 s: a restarted worker's first call took over 1 s on a 2-core box with a CPU hog and a test suite
# running (it was then replaced as hung); the hang tests wait this long once per hang

BROKEN_INIT = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights in " + args["model_name"])

    def execute(self, requests):
        return []
"""

BROKEN_INIT_CONFIG = """
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }]
"""

# No tensors in config.pbtxt: auto_complete_config declares them (Triton's auto_complete example).
AUTO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "IN", "data_type": "TYPE_FP32", "dims": [3]}]
        outputs = [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for input in inputs:
            if input["name"] not in input_names:
                auto_complete_model_config.add_input(input)
        for output in outputs:
            if output["name"] not in output_names:
                auto_complete_model_config.add_output(output)
        auto_complete_model_config.set_max_batch_size(2)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]))
        return responses
"""

AUTO_CONFIG = 'backend: "python"\n'

# Says how execute() saw the batch: requests in this call, rows in this request; X < 0 is refused.
BATCH_PROBE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative X", pb_utils.TritonError.INVALID_ARG)))
                continue
            rows = x.shape[0]
            n = np.full((rows, 1), len(requests), dtype=np.int32)
            own = np.full((rows, 1), rows, dtype=np.int32)
            tensors = [pb_utils.Tensor("N", n), pb_utils.Tensor("ROWS", own), pb_utils.Tensor("Y", x * 10)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

BATCH_PROBE_CONFIG = """
backend: "python"
max_batch_size: 8
input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]
output [
  { name: "N" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 300000 }
"""

MODELS: dict[str, tuple[str, str]] = {
    "add_sub": (ADD_SUB, ADD_SUB_CONFIG),
    "strings": (STRINGS, STRINGS_CONFIG),
    "faulty": (FAULTY, FAULTY_CONFIG),
    "broken_init": (BROKEN_INIT, BROKEN_INIT_CONFIG),
    "auto": (AUTO, AUTO_CONFIG),
    "batch_probe": (BATCH_PROBE, BATCH_PROBE_CONFIG),
}


def write_model(repo: Path, name: str, source: str | None = None, config: str | None = None) -> Path:
    """<repo>/<name>/config.pbtxt + 1/model.py; the model file's path."""
    default_source, default_config = MODELS.get(name, ("", ""))
    folder = repo / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config if config is not None else default_config)
    path = folder / "model.py"
    path.write_text(source if source is not None else default_source)
    return path


def write_repo(repo: Path, names: list[str]) -> Path:
    for name in names:
        write_model(repo, name)
    return repo


def worker_pids(parent: int | None = None) -> list[int]:
    """Live (not zombie) Python model workers, children of `parent` when given."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if b"edgeserve.backends.python.worker" not in cmdline:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if state != "Z" and (parent is None or ppid == parent):
            found.append(int(entry))
    return found
