"""sequence_batching config parsing and checks, the sequence parameters (Triton's rules, the ZeroMQ
header shorthands), auto-complete leaving server-fed inputs out, and the warm-up's control rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sched_helpers import make_config

from edgeserve.backends.base import ModelIO, TensorSpec
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.zmq import codec
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository import autocomplete
from edgeserve.scheduling.sequence_config import parse, sequence_flags, server_inputs, warmup_inputs

BASE = 'name: "m"\nmax_batch_size: 4\n'
START = '{ name: "START", control [ { kind: CONTROL_SEQUENCE_START, fp32_false_true: [ 0, 1 ] } ] }'
R = 'name: "R", control [ { kind: CONTROL_SEQUENCE_READY'
C = 'name: "C", control [ { kind: CONTROL_SEQUENCE_CORRID'
STATE = '{ input_name: "S_IN", output_name: "S_OUT", data_type: TYPE_FP32, dims: [ 2 ] }'


def test_sequence_flags() -> None:
    assert sequence_flags({"sequence_id": 7, "sequence_start": True}, "m") == (("u", 7), True, False)
    assert sequence_flags({"sequence_id": "cam", "sequence_end": True}, "m") == (("s", "cam"), False, True)
    assert sequence_flags({"sequence_id": 2**64 - 1}, "m")[0] == ("u", 2**64 - 1)
    for missing in ({}, {"sequence_id": 0}, {"sequence_id": ""}):
        with pytest.raises(InferenceError, match="must specify a non-zero or non-empty correlation ID"):
            sequence_flags(missing, "m")
    for bad in (-1, 1.5, True, 2**64):
        with pytest.raises(InferenceError) as err:
            sequence_flags({"sequence_id": bad}, "m")
        assert err.value.status is Status.INVALID_ARG
    with pytest.raises(InferenceError, match="booleans"):
        sequence_flags({"sequence_id": 1, "sequence_start": 1}, "m")


def test_zmq_header_shorthands() -> None:
    header = {
        "model": "m", "inputs": [], "sequence_id": "cam-1", "sequence_start": True, "sequence_end": False,
        "parameters": {"custom": 1},
    }  # fmt: skip
    decoded = codec.decode_infer(header, [], SharedMemoryRegistry())
    assert decoded.request.parameters == {
        "custom": 1, "sequence_id": "cam-1", "sequence_start": True, "sequence_end": False,
    }  # fmt: skip
    with pytest.raises(InferenceError, match="sequence_start"):
        codec.decode_infer({"model": "m", "inputs": [], "sequence_start": 1}, [], SharedMemoryRegistry())


def test_parse_defaults_and_strategies() -> None:
    spec = parse(make_config(BASE + f"sequence_batching {{ control_input [ {START} ] state [ {STATE} ] }}"))
    assert not spec.oldest and spec.idle_ns == 1_000_000_000 and spec.max_rows == 4
    assert spec.server_inputs == {"START", "S_IN"}
    text = (
        "oldest { max_candidate_sequences: 3 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 50 }"
    )
    oldest = parse(make_config(BASE + f"sequence_batching {{ {text} }}"))
    assert (
        oldest.oldest
        and oldest.max_candidates == 3
        and oldest.preferred_rows == 2
        and oldest.delay_ns == 50_000
    )
    rows = spec.control_rows([(True, False, True, ("u", 1)), (False, False, False, None)])
    assert rows["START"].tolist() == [[1.0], [0.0]] and rows["START"].dtype == np.float32


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (f"control_input [ {{ {R} }} ] }} ]", "needs int32_false_true"),
        (f"control_input [ {{ {R}, int32_false_true: [ 1 ] }} ] }} ]",
         "exactly two values"),
        (f'control_input [ {START}, {START.replace("START", "B", 1)} ]', "a second START control"),
        (f"control_input [ {{ {C}, data_type: TYPE_FP32 }} ] }} ]",
         "CORRID needs"),
        ('state [ { input_name: "S", output_name: "T", data_type: TYPE_FP32, dims: [ -1 ] } ]', "fixed dims"),
        ('state [ { input_name: "S", data_type: TYPE_FP32, dims: [ 1 ] } ]', "input_name and output_name"),
        ("oldest { preferred_batch_size: [ 9 ] }", "between 1 and 4"),
        ('state [ { input_name: "S", output_name: "T", data_type: TYPE_FP32, dims: [ 2 ] initial_state [ '
         '{ data_type: TYPE_FP32, dims: [ 2 ], data_file: "missing.bin", name: "i" } ] } ]', "missing.bin"),
    ],
)  # fmt: skip
def test_parse_errors_name_the_field(tmp_path: Path, body: str, words: str) -> None:
    with pytest.raises(RepositoryError) as err:
        parse(make_config(BASE + f"sequence_batching {{ {body} }}"), "m/config.pbtxt", tmp_path)
    assert err.value.message.startswith("m/config.pbtxt: sequence_batching.") and words in err.value.message


def test_initial_state_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "initial_state").mkdir()
    np.array([1.5, -2.0], np.float32).tofile(tmp_path / "initial_state" / "s.bin")
    text = STATE.replace("dims: [ 2 ] }", 'dims: [ 2 ] initial_state [ { data_type: TYPE_FP32, dims: [ 2 ], '
                         'data_file: "s.bin", name: "i" } ] }')  # fmt: skip
    spec = parse(make_config(BASE + f"sequence_batching {{ state [ {text} ] }}"), "w", tmp_path)
    assert spec.states[0].start_value().tolist() == [1.5, -2.0]


def test_autocomplete_leaves_server_inputs_out_and_warmup_fills_them() -> None:
    config = make_config(
        'name: "m"\nmax_batch_size: 4\ninput [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        f"sequence_batching {{ control_input [ {START} ] state [ {STATE} ] }}"
    )
    io = ModelIO(
        tuple(TensorSpec(n, "FP32", (-1, 2) if n != "START" else (-1, 1)) for n in ("X", "START", "S_IN")),
        (TensorSpec("Y", "FP32", (-1, 2)), TensorSpec("S_OUT", "FP32", (-1, 2))),
    )
    done = autocomplete.complete(config, io, model_name="m", backend_name="onnxruntime", platform="",
                                 model_file="model.onnx", default_max_batch_size=4)  # fmt: skip
    assert [t.name for t in done.input] == ["X"] and server_inputs(done) == {"START", "S_IN"}
    sample = warmup_inputs(done, {"X": np.zeros((3, 2), np.float32)})
    assert sample["START"].shape == (3, 1) and sample["S_IN"].shape == (3, 2)
