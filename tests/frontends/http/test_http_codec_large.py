"""Big JSON answers (codec.encode_response): encoded a slice at a time, the same document as in one
piece, and off the event loop (`encode_off_loop`) only when a JSON output is big. A 4-million-float
JSON answer encoded in one piece on the loop kept every other connection waiting for tens of seconds
on a busy box (tests/faults/test_faults_e2e.py::test_http_clients_leaving_mid_request_leak_nothing
met a fresh connection closed unanswered)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeserve.frontends.http import codec
from edgeserve.protocol.inference import InferRequest, InferResponse, OutputTensor, RequestedOutput, ShmRef

BIG = codec.JSON_SLICE_ELEMENTS + 1


def _response() -> InferResponse:
    response = InferResponse("m", "2", "req-1", parameters={"sequence_end": True})
    floats = np.arange(10, dtype=np.float32).reshape(2, 5) / 3
    floats[0, 0], floats[0, 1], floats[0, 2] = np.nan, np.inf, -np.inf
    response.outputs.append(OutputTensor("f", "FP32", (2, 5), floats, parameters={"note": "x"}))
    response.outputs.append(OutputTensor("i", "INT64", (7,), np.arange(-3, 4, dtype=np.int64)))
    response.outputs.append(OutputTensor("b", "BOOL", (3,), np.array([True, False, True])))
    response.outputs.append(
        OutputTensor("s", "BYTES", (3,), np.array([b"x", "y\u00e9".encode(), b'"q"'], object))
    )
    response.outputs.append(OutputTensor("e", "FP32", (0, 4), np.zeros((0, 4), np.float32)))
    response.outputs.append(OutputTensor("raw", "UINT8", (6,), np.arange(6, dtype=np.uint8)))
    response.outputs.append(OutputTensor("m", "FP32", (4,), None, shm=ShmRef("out", 16, 32)))
    return response


def _canonical(chunks: list[bytes | memoryview], length: int | None) -> tuple[str, bytes]:
    body = b"".join(bytes(c) for c in chunks)
    header = body if length is None else body[:length]
    return json.dumps(json.loads(header), sort_keys=True), body[len(header) :]


@pytest.mark.parametrize("slice_elements", [1, 2, 3, 7])
def test_a_sliced_answer_is_the_same_document(monkeypatch: pytest.MonkeyPatch, slice_elements: int) -> None:
    request = InferRequest(
        "m", outputs=[RequestedOutput(n) for n in "fibse"] + [RequestedOutput("raw", binary=True)]
    )
    whole = _canonical(*codec.encode_response(_response(), request, binary_default=False))
    monkeypatch.setattr(codec, "JSON_SLICE_ELEMENTS", slice_elements)
    sliced = _canonical(*codec.encode_response(_response(), request, binary_default=False))
    assert sliced == whole
    assert '"data": [NaN, Infinity, -Infinity' in whole[0] and whole[1] == bytes(range(6))


def test_only_a_big_json_answer_leaves_the_event_loop() -> None:
    big = InferResponse("m", "1", "")
    big.outputs.append(OutputTensor("y", "FP32", (BIG,), np.zeros(BIG, np.float32)))
    assert codec.encode_off_loop(big, InferRequest("m"), binary_default=False)
    assert not codec.encode_off_loop(big, InferRequest("m"), binary_default=True)  # binary: a copy at most
    binary = InferRequest("m", outputs=[RequestedOutput("y", binary=True)])
    assert not codec.encode_off_loop(big, binary, binary_default=False)
    small = InferResponse("m", "1", "")
    small.outputs.append(OutputTensor("y", "FP32", (BIG - 1,), np.zeros(BIG - 1, np.float32)))
    assert not codec.encode_off_loop(small, InferRequest("m"), binary_default=False)
    chunks, length = codec.encode_response(big, InferRequest("m"), binary_default=False)
    assert length is None and json.loads(bytes(chunks[0]))["outputs"][0]["data"] == [0.0] * BIG
