"""One sequence batch: assemble the rows (client inputs, control inputs, implicit state), run the
instance, split the outputs per request and take each sequence's next state."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.job import Arrays, Job
from edgeserve.scheduling.sequence_config import Array, SequenceKey, SequenceSpec, StateSpec

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance


@dataclass(slots=True)
class Step:
    job: Job
    start: bool
    end: bool


@dataclass(slots=True, eq=False)
class Sequence:
    key: SequenceKey
    slot: tuple[int, int] | None = None  # Direct: (instance, row); Oldest: (-1, -1); None: backlog
    state: dict[str, Any] | None = None
    pending: deque[Step] = field(default_factory=deque)
    busy: bool = False
    ended: bool = False  # an END is queued: only a new START may follow
    last_ns: int = 0


@dataclass(slots=True)
class Row:
    row: int  # Direct: the sequence's slot; Oldest: its position in the batch
    key: SequenceKey
    start: bool
    end: bool
    inputs: Arrays  # the request's (a leading batch axis of 1 when the model batches)
    state: dict[str, Array] | None  # the sequence's state; None = start values


def _blank(like: Array) -> Array:
    """An empty slot's row for a client input (READY=0 tells the model to ignore it)."""
    if like.dtype == np.object_:
        out = np.empty(like.shape, dtype=np.object_)
        out.reshape(-1)[:] = [b""] * out.size
        return out
    return np.zeros_like(like)


def _state_of(row: Row | None, spec: StateSpec) -> Array:
    if row is None or row.state is None or spec.input_name not in row.state:
        return spec.start_value()
    return row.state[spec.input_name]


def _assemble(spec: SequenceSpec, rows: list[Row]) -> Arrays:
    if not spec.batching:
        row = rows[0]
        inputs = dict(row.inputs)
        inputs.update(spec.control_rows([(row.start, row.end, True, row.key)]))
        for state in spec.states:
            inputs[state.input_name] = _state_of(row, state)
        return inputs
    count = rows[-1].row + 1
    by_row: dict[int, Row] = {row.row: row for row in rows}
    slots = [by_row.get(i) for i in range(count)]
    inputs = {}
    for name, first in rows[0].inputs.items():
        parts = [row.inputs[name] if row is not None else _blank(first) for row in slots]
        inputs[name] = parts[0] if count == 1 else np.concatenate(parts, axis=0)
    flags: list[tuple[bool, bool, bool, SequenceKey | None]] = [
        (row.start, row.end, True, row.key) if row is not None else (False, False, False, None)
        for row in slots
    ]
    inputs.update(spec.control_rows(flags))
    for state in spec.states:
        inputs[state.input_name] = np.stack([_state_of(row, state) for row in slots])
    return inputs


def _next_state(spec: SequenceSpec, outputs: dict[str, Any], row: Row) -> dict[str, Array]:
    state: dict[str, Array] = {}
    for entry in spec.states:
        if entry.output_name not in outputs:
            raise InferenceError(
                Status.INTERNAL, f"the model did not produce state output '{entry.output_name}'"
            )
        array = np.asarray(outputs[entry.output_name])
        value = array[row.row] if spec.batching else array
        if tuple(value.shape) != entry.dims:
            shapes = f"{list(value.shape)}, the config's state dims are {list(entry.dims)}"
            raise InferenceError(Status.INTERNAL, f"state output '{entry.output_name}' has shape {shapes}")
        state[entry.input_name] = np.array(value, dtype=entry.dtype, copy=True)
    return state


def run_batch(
    spec: SequenceSpec, instance: Instance, rows: list[Row]
) -> tuple[list[Arrays], list[dict[str, Array]], tuple[int, int, int]]:
    """(per-row outputs, per-row next state, (start, infer start, infer end) monotonic ns).
    `rows` are sorted by `row`."""
    start_ns = time.monotonic_ns()
    inputs = _assemble(spec, rows)
    infer_start = time.monotonic_ns()
    outputs = instance.infer(inputs)
    infer_end = time.monotonic_ns()
    count = rows[-1].row + 1
    results: list[Arrays] = []
    states: list[dict[str, Array]] = []
    for row in rows:
        if spec.batching:
            for name, array in outputs.items():
                if np.ndim(array) == 0 or np.shape(array)[0] != count:
                    shape = list(np.shape(array))
                    message = f"output '{name}' has shape {shape}, expected {count} rows for the batch"
                    raise InferenceError(Status.INTERNAL, message)
            results.append({name: array[row.row : row.row + 1] for name, array in outputs.items()})
        else:
            results.append(dict(outputs))
        states.append(_next_state(spec, outputs, row))
    return results, states, (start_ns, infer_start, infer_end)
