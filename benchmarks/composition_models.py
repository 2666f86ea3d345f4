"""The model repository of bench_composition.py: one pipeline (pre-process -> ONNX classifier ->
post-process) written the ways a Triton user composes models, plus a BLS hop probe and a decoupled
stream. Shapes: IMAGE [1, 224, 224, 3] UINT8 (147 KB) -> NORM [1, 3, 224, 224] FP32 (602 KB, the
tensor that crosses between the steps) -> LOGITS [1, 1000] FP32 -> CLASS [1] INT64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PRE = """
import numpy as np
import triton_python_backend_utils as pb_utils

MEAN = (np.array([0.485, 0.456, 0.406], np.float32) * 255).reshape(1, 3, 1, 1)
SCALE = 1 / (np.array([0.229, 0.224, 0.225], np.float32) * 255).reshape(1, 3, 1, 1)


def normalise(image):
    return np.ascontiguousarray((image.transpose(0, 3, 1, 2).astype(np.float32) - MEAN) * SCALE)


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("NORM", normalise(
            pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()))]) for r in requests]
"""
POST = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("CLASS", np.argmax(
            pb_utils.get_input_tensor_by_name(r, "LOGITS").as_numpy(), axis=1).astype(np.int64))])
            for r in requests]
"""
# Triton's idiom: pre- and post-processing in Python around the ONNX model, called with BLS.
BLS = """
import numpy as np
import triton_python_backend_utils as pb_utils

MEAN = (np.array([0.485, 0.456, 0.406], np.float32) * 255).reshape(1, 3, 1, 1)
SCALE = 1 / (np.array([0.229, 0.224, 0.225], np.float32) * 255).reshape(1, 3, 1, 1)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            norm = np.ascontiguousarray((image.transpose(0, 3, 1, 2).astype(np.float32) - MEAN) * SCALE)
            answer = pb_utils.InferenceRequest(model_name="classifier", requested_output_names=["LOGITS"],
                                               inputs=[pb_utils.Tensor("NORM", norm)]).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            logits = pb_utils.get_output_tensor_by_name(answer, "LOGITS").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("CLASS", np.argmax(logits, axis=1).astype(np.int64))]))
        return responses
"""
# One BLS call, timed inside the model: HOP_NS is what exec() took, to set against the classifier's own
# compute time from its statistics.
HOP = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            norm = pb_utils.get_input_tensor_by_name(request, "NORM")
            start = time.perf_counter_ns()
            answer = pb_utils.InferenceRequest(model_name="classifier", requested_output_names=["LOGITS"],
                                               inputs=[norm]).exec()
            took = time.perf_counter_ns() - start
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(answer, "LOGITS"),
                pb_utils.Tensor("HOP_NS", np.array([took], np.int64))]))
        return responses
"""
STREAM = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

IMAGE = 'input [{ name: "IMAGE" data_type: TYPE_UINT8 dims: [ 1, 224, 224, 3 ] }]'
NORM_IN = 'input [{ name: "NORM" data_type: TYPE_FP32 dims: [ 1, 3, 224, 224 ] }]'
NORM_OUT = 'output [{ name: "NORM" data_type: TYPE_FP32 dims: [ 1, 3, 224, 224 ] }]'
LOGITS_IN = 'input [{ name: "LOGITS" data_type: TYPE_FP32 dims: [ 1, 1000 ] }]'
LOGITS_OUT = '{ name: "LOGITS" data_type: TYPE_FP32 dims: [ 1, 1000 ] }'
CLASS = 'output [{ name: "CLASS" data_type: TYPE_INT64 dims: [ 1 ] }]'
ENSEMBLE = f"""
platform: "ensemble" max_batch_size: 0
{IMAGE}
{CLASS}
ensemble_scheduling {{ step [
  {{ model_name: "pre" model_version: -1
     input_map {{ key: "IMAGE" value: "IMAGE" }} output_map {{ key: "NORM" value: "norm" }} }},
  {{ model_name: "classifier" model_version: -1
     input_map {{ key: "NORM" value: "norm" }} output_map {{ key: "LOGITS" value: "logits" }} }},
  {{ model_name: "post" model_version: -1
     input_map {{ key: "LOGITS" value: "logits" }} output_map {{ key: "CLASS" value: "CLASS" }} }}
] }}
"""
CONFIGS = {
    "pre": f'backend: "python" max_batch_size: 0\n{IMAGE}\n{NORM_OUT}\n',
    "classifier": f'backend: "onnxruntime" max_batch_size: 0\n{NORM_IN}\noutput [{LOGITS_OUT}]\n',
    "post": f'backend: "python" max_batch_size: 0\n{LOGITS_IN}\n{CLASS}\n',
    "pipeline": ENSEMBLE,
    "pipeline_bls": f'backend: "python" max_batch_size: 0\n{IMAGE}\n{CLASS}\n',
    "bls_hop": f'backend: "python" max_batch_size: 0\n{NORM_IN}\noutput [{LOGITS_OUT}, '
    '{ name: "HOP_NS" data_type: TYPE_INT64 dims: [ 1 ] }]\n',
    "stream": 'backend: "python" max_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
    'input [{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
    'output [{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }]\n',
}
SOURCES = {"pre": PRE, "post": POST, "pipeline_bls": BLS, "bls_hop": HOP, "stream": STREAM}


def classifier_onnx(path: Path) -> Path:
    """A small classifier: global average pool over the image, then a 3 x 1000 linear layer."""
    from onnx import TensorProto, helper, numpy_helper, save

    weights = np.random.default_rng(7).standard_normal((3, 1000)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["NORM"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("MatMul", ["flat", "W"], ["LOGITS"])],
        "classifier",
        [helper.make_tensor_value_info("NORM", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, [1, 1000])],
        [numpy_helper.from_array(weights, "W")],
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def write_repository(root: Path) -> Path:
    for name, config in CONFIGS.items():
        folder = root / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
        if name in SOURCES:
            (folder / "1" / "model.py").write_text(SOURCES[name])
    classifier_onnx(root / "classifier" / "1" / "model.onnx")
    return root


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)
