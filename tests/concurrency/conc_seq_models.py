"""The concurrency suite's sequence models (built in the test) and their client-side references.

INPUT [1] -> OUTPUT = the running sum of the sequence's INPUTs, kept by the server as implicit state
(STATE_IN -> STATE_OUT); every control input the server feeds (START, END, READY as int32 / fp32 /
bool with their false/true values, CORRID as uint64 / int64 / uint32 / int32 / string) is echoed back
(ECHO_<KIND>), so the client checks each one. The Python sequence model is written as Triton's Python
backend users write one: one request per sequence step (each request holds one row), scalars read
from row 0; it also answers ROWS (the rows its request held) and the request's own flags() and
correlation_id().
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper
from onnx_models import _save

FLAG_TYPES: dict[str, tuple[str, Any, int]] = {
    "int32": ("int32_false_true", np.int32, TensorProto.INT32),
    "fp32": ("fp32_false_true", np.float32, TensorProto.FLOAT),
    "bool": ("bool_false_true", np.bool_, TensorProto.BOOL),
}
CORRID_TYPES: dict[str, tuple[str, Any, int]] = {
    "uint64": ("TYPE_UINT64", np.uint64, TensorProto.UINT64),
    "int64": ("TYPE_INT64", np.int64, TensorProto.INT64),
    "uint32": ("TYPE_UINT32", np.uint32, TensorProto.UINT32),
    "int32": ("TYPE_INT32", np.int32, TensorProto.INT32),
    "string": ("TYPE_STRING", np.object_, TensorProto.STRING),
}
# Sequence IDs per CORRID type: numeric IDs start where the type's range is widest (uint64 past
# 2**63, uint32 past 2**31), so a CORRID squeezed through a narrower type shows.
ID_BASE = {"uint64": 2**63 + 7, "int64": 2**40 + 7, "uint32": 2**31 + 7, "int32": 7, None: 2**50 + 7}
NARROW_UINT64_BASE = 2**62 + 7


@dataclass(frozen=True)
class Flag:
    kind: str  # START, END, READY
    dtype: str  # int32, fp32, bool
    false: float = 0
    true: float = 1

    def value(self, on: bool) -> float:
        return float(self.true if on else self.false)

    def pbtxt(self) -> str:
        field_name = FLAG_TYPES[self.dtype][0]
        if self.dtype == "bool":
            values = f"{str(bool(self.false)).lower()}, {str(bool(self.true)).lower()}"
        elif self.dtype == "int32":
            values = f"{int(self.false)}, {int(self.true)}"
        else:
            values = f"{self.false}, {self.true}"
        return (
            f'{{ name: "{self.kind}", control [ {{ kind: CONTROL_SEQUENCE_{self.kind}, '
            f"{field_name}: [ {values} ] }} ] }}"
        )


@dataclass(frozen=True)
class SeqModel:
    name: str
    backend: str  # onnxruntime or python
    strategy: str  # direct or oldest
    flags: tuple[Flag, ...]
    corrid: str | None  # a CORRID_TYPES key, or no CORRID control
    max_batch: int = 4  # 0: no batch axis
    instances: int = 1
    idle_us: int = 120_000_000  # long: a slow shared box must not expire a sequence mid-way

    kind = "sequence"

    @property
    def outputs(self) -> list[str]:
        names = ["OUTPUT"] + [f"ECHO_{f.kind}" for f in self.flags]
        names += ["ECHO_CORRID"] if self.corrid else []
        return names + (["ROWS", "REQ_FLAGS", "REQ_CORRID"] if self.backend == "python" else [])

    def sequence_id(self, seed: int, run: int, client: int, number: int, wide: bool = True) -> int | str:
        """A sequence ID unique per (seed, run, client, number) that the CORRID type holds. `wide`
        False: below 2**63 (tritonclient.grpc sends every sequence ID as int64_param)."""
        if self.corrid == "string":
            return f"s{seed}-r{run}-c{client}-n{number}"
        base = ID_BASE[self.corrid] if wide or self.corrid != "uint64" else NARROW_UINT64_BASE
        return int(base + (run % 64) * 2**24 + (client % 128) * 2**17 + number % 2**17)

    def corrid_value(self, sequence_id: int | str) -> int | bytes | None:
        """What the server must feed CORRID for this sequence (Triton: the ID in the control's type)."""
        if not self.corrid:
            return None
        if self.corrid == "string":
            return str(sequence_id).encode()
        return int(sequence_id)

    def input_shape(self) -> tuple[int, ...]:
        return (1, 1) if self.max_batch else (1,)

    def write(self, repo: Path) -> None:
        folder = repo / self.name / "1"
        folder.mkdir(parents=True, exist_ok=True)
        if self.backend == "python":
            (folder / "model.py").write_text(PY_SEQUENCE)
        else:
            build_sequence(folder / "model.onnx", self)
        (repo / self.name / "config.pbtxt").write_text(self.config())

    def config(self) -> str:
        dims = "[ 1 ]"
        controls = [f.pbtxt() for f in self.flags]
        if self.corrid:
            controls.append(
                f'{{ name: "CORRID", control [ {{ kind: CONTROL_SEQUENCE_CORRID, '
                f"data_type: {CORRID_TYPES[self.corrid][0]} }} ] }}"
            )
        outputs = [f'{{ name: "OUTPUT", data_type: TYPE_FP32, dims: {dims} }}']
        outputs += [f'{{ name: "ECHO_{f.kind}", data_type: TYPE_FP32, dims: {dims} }}' for f in self.flags]
        if self.corrid:
            outputs.append(
                f'{{ name: "ECHO_CORRID", data_type: {CORRID_TYPES[self.corrid][0]}, dims: {dims} }}'
            )
        if self.backend == "python":
            outputs.append(f'{{ name: "ROWS", data_type: TYPE_INT32, dims: {dims} }}')
            outputs.append(f'{{ name: "REQ_FLAGS", data_type: TYPE_INT32, dims: {dims} }}')
            outputs.append(f'{{ name: "REQ_CORRID", data_type: TYPE_STRING, dims: {dims} }}')
        if self.strategy == "oldest":
            strategy = (
                f"oldest {{ max_candidate_sequences: {2 * max(self.max_batch, 1)} "
                f"preferred_batch_size: [ {max(self.max_batch, 1)} ] max_queue_delay_microseconds: 1000 }}"
            )
        else:
            strategy = "direct { max_queue_delay_microseconds: 1000 minimum_slot_utilization: 0.5 }"
        state = f'{{ input_name: "STATE_IN", output_name: "STATE_OUT", data_type: TYPE_FP32, dims: {dims} }}'
        joined_controls = ",\n    ".join(controls)
        joined_outputs = ",\n  ".join(outputs)
        return textwrap.dedent(f"""\
            backend: "{self.backend}"
            max_batch_size: {self.max_batch}
            input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: {dims} }} ]
            output [
              {joined_outputs}
            ]
            instance_group [ {{ kind: KIND_CPU, count: {self.instances} }} ]
            sequence_batching {{
              max_sequence_idle_microseconds: {self.idle_us}
              control_input [
                {joined_controls}
              ]
              {strategy}
              state [ {state} ]
            }}
            """)


def build_sequence(path: Path, model: SeqModel) -> Path:
    """OUTPUT = STATE_OUT = STATE_IN + INPUT (the server resets the state at START, not the model);
    ECHO_<kind> = the control input as FP32, ECHO_CORRID = CORRID unchanged."""
    shape: list[int | str] = ["N", 1] if model.max_batch else [1]
    nodes = [
        helper.make_node("Add", ["STATE_IN", "INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("INPUT", "STATE_IN")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("OUTPUT", "STATE_OUT")]
    for flag in model.flags:
        inputs.append(helper.make_tensor_value_info(flag.kind, FLAG_TYPES[flag.dtype][2], shape))
        nodes.append(helper.make_node("Cast", [flag.kind], [f"ECHO_{flag.kind}"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info(f"ECHO_{flag.kind}", TensorProto.FLOAT, shape))
    if model.corrid:
        onnx_type = CORRID_TYPES[model.corrid][2]
        inputs.append(helper.make_tensor_value_info("CORRID", onnx_type, shape))
        nodes.append(helper.make_node("Identity", ["CORRID"], ["ECHO_CORRID"]))
        outputs.append(helper.make_tensor_value_info("ECHO_CORRID", onnx_type, shape))
    return Path(_save(helper.make_graph(nodes, "sequence_echo", inputs, outputs), path))


# Written the way Triton's Python backend documents sequence models: execute() gets one request per
# sequence step (padding slots too, with READY false), each holding one row of every input.
PY_SEQUENCE = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.controls = {}
        for entry in config["sequence_batching"]["control_input"]:
            self.controls[entry["control"][0]["kind"].replace("CONTROL_SEQUENCE_", "")] = entry["name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "STATE_IN").as_numpy()
            total = float(state.reshape(-1)[0]) + float(x.reshape(-1)[0])
            rows = x.shape[0] if x.ndim > 1 else 1
            out = [
                pb_utils.Tensor("OUTPUT", np.full(x.shape, total, np.float32)),
                pb_utils.Tensor("STATE_OUT", np.full(x.shape, total, np.float32)),
                pb_utils.Tensor("ROWS", np.full(x.shape, rows, np.int32)),
                pb_utils.Tensor("REQ_FLAGS", np.full(x.shape, request.flags(), np.int32)),
                pb_utils.Tensor("REQ_CORRID", np.full(x.shape, str(request.correlation_id()).encode(),
                                                      dtype=np.object_)),
            ]
            for kind, name in self.controls.items():
                control = pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                first = control.reshape(-1)[0]
                if kind == "CORRID":
                    out.append(pb_utils.Tensor("ECHO_CORRID", np.full(x.shape, first, control.dtype)))
                else:
                    out.append(pb_utils.Tensor("ECHO_" + kind, np.full(x.shape, float(first), np.float32)))
            responses.append(pb_utils.InferenceResponse(out))
        return responses
"""


SEQUENCES = (
    SeqModel(
        "seq_u64_direct",
        "onnxruntime",
        "direct",
        (Flag("START", "int32"), Flag("END", "int32"), Flag("READY", "int32")),
        "uint64",
        4,
        2,
    ),
    SeqModel(
        "seq_i64_oldest",
        "onnxruntime",
        "oldest",
        (Flag("START", "fp32"), Flag("END", "fp32"), Flag("READY", "fp32")),
        "int64",
        4,
        1,
    ),
    SeqModel(
        "seq_u32_nobatch",
        "onnxruntime",
        "direct",
        (Flag("START", "bool"), Flag("END", "bool"), Flag("READY", "bool")),
        "uint32",
        0,
        3,
    ),
    SeqModel(
        "seq_i32_oldest",
        "onnxruntime",
        "oldest",
        (Flag("START", "bool"), Flag("END", "int32", 5, 9), Flag("READY", "fp32", -1.0, 0.5)),
        "int32",
        8,
        2,
    ),
    SeqModel(
        "seq_str_direct",
        "onnxruntime",
        "direct",
        (Flag("START", "int32", 3, -3), Flag("READY", "bool")),
        "string",
        4,
        1,
    ),
    SeqModel(
        "pyseq_direct",
        "python",
        "direct",
        (Flag("START", "int32"), Flag("END", "int32"), Flag("READY", "int32")),
        "uint64",
        4,
        1,
    ),
    SeqModel(
        "pyseq_oldest",
        "python",
        "oldest",
        (Flag("START", "fp32"), Flag("END", "bool"), Flag("READY", "fp32", 0.0, 2.0)),
        "string",
        4,
        1,
    ),
)
