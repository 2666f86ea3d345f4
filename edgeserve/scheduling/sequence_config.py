"""`sequence_batching` in config.pbtxt: control inputs, implicit state, strategy, and their checks.

The server feeds the control inputs (START, END, READY, CORRID) and the state inputs itself; clients
send only the model's other inputs, so these names stay out of the config's `input` list (as in
Triton). A row of a batch gets, per control: the false/true value of its flag (READY is false on an
empty Direct slot), or its correlation ID (CORRID, in the control's data_type). A state input gets
the sequence's previous value of the state output, or zeros / `initial_state` at START.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status

Array = npt.NDArray[Any]
SequenceKey = tuple[str, int | str]  # ("u", 42) or ("s", "abc"): numeric and string IDs never mix

DEFAULT_IDLE_US = 1_000_000  # Triton's default when max_sequence_idle_microseconds is unset or 0
_KIND = mc.ModelSequenceBatching.Control
KIND_NAMES = {_KIND.CONTROL_SEQUENCE_START: "START", _KIND.CONTROL_SEQUENCE_READY: "READY",
              _KIND.CONTROL_SEQUENCE_END: "END", _KIND.CONTROL_SEQUENCE_CORRID: "CORRID"}  # fmt: skip
_CORRID_TYPES = {mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING}


def _numpy_dtype(data_type: int) -> np.dtype[Any]:
    name = mc.DataType.Name(data_type)
    return np.dtype(datatypes.numpy_dtype(datatypes.config_to_protocol(name)))


@dataclass(frozen=True, slots=True)
class Control:
    name: str
    kind: str  # START, READY, END or CORRID
    dtype: np.dtype[Any]
    false: Any = 0
    true: Any = 1


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    dtype: np.dtype[Any]
    dims: tuple[int, ...]
    initial: Array | None  # None = zeros

    def start_value(self) -> Array:
        if self.initial is not None:
            return self.initial
        if self.dtype == np.object_:
            out = np.empty(self.dims, dtype=np.object_)
            out.reshape(-1)[:] = [b""] * out.size
            return out
        return np.zeros(self.dims, dtype=self.dtype)


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    controls: tuple[Control, ...]
    states: tuple[StateSpec, ...]
    idle_ns: int
    oldest: bool  # the Oldest strategy; else Direct
    batching: bool  # max_batch_size > 0: a batch axis, rows from several sequences
    max_rows: int  # rows per batch (1 without batching)
    max_candidates: int  # Oldest: sequences holding a place at once (0 = slots of all instances)
    # Wait up to delay_ns for this many rows: Oldest's largest preferred_batch_size (else
    # max_batch_size), Direct's minimum_slot_utilization x slots (0, the default: one row).
    preferred_rows: int
    delay_ns: int

    @property
    def server_inputs(self) -> set[str]:
        return {c.name for c in self.controls} | {s.input_name for s in self.states}

    def control_rows(self, rows: list[tuple[bool, bool, bool, SequenceKey | None]]) -> dict[str, Array]:
        """Per control input, one value per row: (start, end, ready, key) of each row, in batch order.
        Each row is shape [1]; a batching model gets [rows, 1], else [1]."""
        out: dict[str, Array] = {}
        for control in self.controls:
            values: list[Any] = []
            for start, end, ready, key in rows:
                if control.kind == "CORRID":
                    values.append(_corrid(control, key))
                else:
                    flag = {"START": start, "END": end, "READY": ready}[control.kind]
                    values.append(control.true if flag else control.false)
            array = np.array(values, dtype=control.dtype).reshape(len(rows), 1)
            out[control.name] = array if self.batching else array.reshape(1)
        return out


def sequence_flags(parameters: Mapping[str, Any], model_name: str) -> tuple[SequenceKey, bool, bool]:
    """(key, start, end) from a request's parameters; INVALID_ARG for a missing or bad ID."""
    value = parameters.get("sequence_id", 0)
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise InferenceError(Status.INVALID_ARG, "sequence_start and sequence_end must be booleans")
    if isinstance(value, str) and value:
        return ("s", value), start, end
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**64:
        return ("u", value), start, end
    if value in (0, ""):
        raise InferenceError(Status.INVALID_ARG, f"inference request to model '{model_name}' must specify a "
                             "non-zero or non-empty correlation ID")  # fmt: skip
    raise InferenceError(Status.INVALID_ARG, f"sequence_id {value!r} must be an unsigned integer or a string")


def _corrid(control: Control, key: SequenceKey | None) -> Any:
    if key is None:
        return b"" if control.dtype == np.object_ else 0
    if control.dtype == np.object_:
        return str(key[1]).encode()
    if key[0] == "s":
        raise InferenceError(Status.INVALID_ARG, f"sequence ID '{key[1]}' is a string but the CORRID control "
                             f"input '{control.name}' is numeric")  # fmt: skip
    return key[1]


def _flag_values(where: str, name: str, control: Any, kind: str) -> Control:
    for field in ("int32_false_true", "fp32_false_true", "bool_false_true"):
        values = list(getattr(control, field))
        if values:
            if len(values) != 2:
                raise _bad(
                    where, f"control_input '{name}'.{field}", "must hold exactly two values: false, true"
                )
            dtype = {"int32_false_true": np.int32, "fp32_false_true": np.float32, "bool_false_true": np.bool_}
            return Control(name, kind, np.dtype(dtype[field]), values[0], values[1])
    raise _bad(where, f"control_input '{name}'", f"{kind} needs int32_false_true, fp32_false_true or "
               "bool_false_true")  # fmt: skip


def _bad(where: str, field: str, problem: str) -> RepositoryError:
    return RepositoryError(where, f"sequence_batching.{field}", problem)


def _initial(
    where: str, state: Any, dtype: np.dtype[Any], dims: tuple[int, ...], model_dir: Path | None
) -> Array | None:
    if not state.initial_state:
        return None
    initial = state.initial_state[0]
    label = f"state '{state.input_name}'.initial_state"
    shape = tuple(int(d) for d in initial.dims)
    if shape != dims or initial.data_type != state.data_type:
        raise _bad(where, label, f"dims {list(shape)} / data_type must equal the state's {list(dims)}")
    if initial.WhichOneof("state_data") == "data_file":
        if model_dir is None:
            return None
        path = model_dir / "initial_state" / initial.data_file
        try:
            data = path.read_bytes()
            datatype = datatypes.config_to_protocol(mc.DataType.Name(state.data_type))
            value: Array = datatypes.from_buffer(data, datatype, dims, str(path)).copy()
            return value
        except (OSError, InferenceError) as exc:
            raise _bad(where, f"{label}.data_file", f"{path}: {getattr(exc, 'message', exc)}") from None
    return np.zeros(dims, dtype=dtype) if dtype != np.object_ else None


def parse(config: Any, where: str = "config.pbtxt", model_dir: Path | None = None) -> SequenceSpec:
    """The model's sequence batcher settings; raises RepositoryError naming the bad field."""
    seq = config.sequence_batching
    controls: list[Control] = []
    names: set[str] = set()
    kinds: set[str] = set()
    for entry in seq.control_input:
        if not entry.name or entry.name in names:
            raise _bad(where, "control_input", f"'{entry.name}': each control input needs a unique name")
        names.add(entry.name)
        if len(entry.control) != 1:
            raise _bad(where, f"control_input '{entry.name}'", "must hold exactly one control")
        control = entry.control[0]
        kind = KIND_NAMES.get(control.kind, "?")
        if kind in kinds:
            raise _bad(where, f"control_input '{entry.name}'", f"a second {kind} control")
        kinds.add(kind)
        if kind == "CORRID":
            if control.data_type not in _CORRID_TYPES:
                types = "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING"
                raise _bad(where, f"control_input '{entry.name}'.data_type", f"CORRID needs {types}")
            controls.append(Control(entry.name, kind, _numpy_dtype(control.data_type)))
        else:
            controls.append(_flag_values(where, entry.name, control, kind))
    states: list[StateSpec] = []
    for state in seq.state:
        if not state.input_name or not state.output_name:
            raise _bad(where, "state", "each state needs input_name and output_name")
        if state.input_name in names:
            raise _bad(where, f"state '{state.input_name}'", "the name is already a control input")
        names.add(state.input_name)
        dims = tuple(int(d) for d in state.dims)
        if not dims or any(d < 1 for d in dims):
            raise _bad(where, f"state '{state.input_name}'.dims", f"{list(dims)}: fixed dims >= 1 are needed")
        dtype = _numpy_dtype(state.data_type)
        states.append(StateSpec(state.input_name, state.output_name, dtype, dims,
                                _initial(where, state, dtype, dims, model_dir)))  # fmt: skip
    batching = config.max_batch_size > 0
    max_rows = int(config.max_batch_size) if batching else 1
    oldest = seq.WhichOneof("strategy_choice") == "oldest"
    delay_us = int(
        seq.oldest.max_queue_delay_microseconds if oldest else seq.direct.max_queue_delay_microseconds
    )
    preferred = [int(p) for p in seq.oldest.preferred_batch_size] if oldest else []
    for size in preferred:
        if not 1 <= size <= max_rows:
            raise _bad(where, "oldest.preferred_batch_size", f"{size} must be between 1 and {max_rows}")
    utilization = float(seq.direct.minimum_slot_utilization)
    if not 0.0 <= utilization <= 1.0:
        raise _bad(where, "direct.minimum_slot_utilization", f"{utilization} must be between 0 and 1")
    rows_wanted = max_rows if oldest else max(1, math.ceil(utilization * max_rows))
    idle_us = int(seq.max_sequence_idle_microseconds) or DEFAULT_IDLE_US
    return SequenceSpec(
        controls=tuple(controls), states=tuple(states), idle_ns=idle_us * 1000, oldest=oldest,
        batching=batching, max_rows=max_rows, max_candidates=int(seq.oldest.max_candidate_sequences),
        preferred_rows=max(preferred) if preferred else rows_wanted, delay_ns=delay_us * 1000,
    )  # fmt: skip


def check(config: Any, where: str, model_dir: Path | None = None) -> None:
    """repository/config.py's validation of a sequence_batching config."""
    spec = parse(config, where, model_dir)
    clash = sorted(spec.server_inputs & {t.name for t in config.input})
    if clash:
        raise _bad(where, "control_input", f"'{clash[0]}' is fed by the server; remove it from the inputs")


def server_inputs(config: Any) -> set[str]:
    """Names the sequence batcher feeds (auto-complete leaves them out of the config's inputs)."""
    if config.WhichOneof("scheduling_choice") != "sequence_batching":
        return set()
    seq = config.sequence_batching
    return {c.name for c in seq.control_input} | {s.input_name for s in seq.state}


def warmup_inputs(config: Any, inputs: Mapping[str, Array]) -> dict[str, Array]:
    """A warm-up sample's `inputs` plus control rows (a one-step sequence each) and start states."""
    spec = parse(config)
    out = dict(inputs)
    rows = int(next(iter(inputs.values())).shape[0]) if spec.batching and inputs else 1
    out.update(spec.control_rows([(True, True, True, None)] * rows))
    for state in spec.states:
        value = state.start_value()
        out[state.input_name] = np.stack([value] * rows) if spec.batching else value
    return out
