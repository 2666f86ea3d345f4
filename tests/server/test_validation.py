from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InputTensor, RequestedOutput
from edgeserve.server.validation import classify, requested_output_names, validated_inputs

CONFIG = text_format.Parse(
    """
    name: "m" max_batch_size: 8
    input [ { name: "IMG" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] },
            { name: "SCALE" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]
    """,
    model_config_pb2.ModelConfig(),
)


def request(*inputs: InputTensor, outputs: list[RequestedOutput] | None = None) -> InferRequest:
    return InferRequest(model_name="m", inputs=list(inputs), outputs=outputs)


def tensor(name: str, shape: tuple[int, ...], datatype: str = "FP32") -> InputTensor:
    return InputTensor(name, datatype, shape, np.zeros(shape, dtype=np.float32))


def test_valid_request_with_dynamic_dims_and_optional_input() -> None:
    arrays, batch = validated_inputs(request(tensor("IMG", (2, 3, 17, 9))), CONFIG, "m")
    assert batch == 2 and arrays["IMG"].shape == (2, 3, 17, 9)


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ((tensor("NOPE", (1, 3, 4, 4)),), "unexpected inference input 'NOPE'"),
        ((tensor("IMG", (1, 3, 4, 4), "INT32"),), "data-type is 'INT32', but model 'm' expects 'FP32'"),
        ((tensor("IMG", (1, 4, 4, 4)),), "Expected [-1,3,-1,-1], got [1, 4, 4, 4]"),
        ((tensor("IMG", (9, 3, 4, 4)),), "batch-size must be <= 8"),
        ((tensor("IMG", (1, 3, 4, 4)), tensor("IMG", (1, 3, 4, 4))), "more than once"),
        ((tensor("IMG", (2, 3, 4, 4)), tensor("SCALE", (1, 1))), "batch size 1, other inputs have 2"),
        ((tensor("SCALE", (1, 1)),), "Missing: IMG"),
    ],
)
def test_invalid_requests_are_invalid_arg_with_clear_messages(
    inputs: tuple[InputTensor, ...], fragment: str
) -> None:
    with pytest.raises(InferenceError) as info:
        validated_inputs(request(*inputs), CONFIG, "m")
    assert info.value.status is Status.INVALID_ARG
    assert fragment in info.value.message


def test_requested_outputs() -> None:
    assert requested_output_names(request(), CONFIG, "m") == ["OUT"]
    with pytest.raises(InferenceError, match="unexpected inference output 'X'"):
        requested_output_names(request(outputs=[RequestedOutput("X")]), CONFIG, "m")


def test_classification_top_n_with_labels() -> None:
    scores = np.array([[0.1, 0.7, 0.2, 0.0], [0.5, 0.1, 0.1, 0.3]], dtype=np.float32)
    out = classify(scores, 2, ["cat", "dog", "fox", "owl"], batched=True)
    assert out.shape == (2, 2)
    assert out[0, 0].decode().startswith("0.700000:1:dog")
    assert out[1, 1].decode().startswith("0.300000:3:owl")
