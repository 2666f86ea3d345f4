"""One sequence batch: assemble the rows (client inputs, control inputs, implicit state), run the
instance, split the outputs per request and take each sequence's next state."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends.base import FLAG_SEQUENCE_END, FLAG_SEQUENCE_START, RequestInfo
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
    request_id: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


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


def _assemble(spec: SequenceSpec, slots: list[Row | None], like: Arrays) -> Arrays:
    """One batch of `slots` (None: an empty Direct slot, padded with a READY=0 row shaped as `like`)."""
    if not spec.batching:
        row = slots[0]
        assert row is not None
        inputs = dict(row.inputs)
        inputs.update(spec.control_rows([(row.start, row.end, True, row.key)]))
        for state in spec.states:
            inputs[state.input_name] = _state_of(row, state)
        return inputs
    inputs = {}
    for name, first in like.items():
        parts = [row.inputs[name] if row is not None else _blank(first) for row in slots]
        inputs[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    flags: list[tuple[bool, bool, bool, SequenceKey | None]] = [
        (row.start, row.end, True, row.key) if row is not None else (False, False, False, None)
        for row in slots
    ]
    inputs.update(spec.control_rows(flags))
    for state in spec.states:
        inputs[state.input_name] = np.stack([_state_of(row, state) for row in slots])
    return inputs


def _slots(rows: list[Row]) -> list[Row | None]:
    """Rows by batch position, 0 to the highest used (Oldest's are contiguous: no gaps)."""
    by_row: dict[int, Row] = {row.row: row for row in rows}
    return [by_row.get(i) for i in range(rows[-1].row + 1)]


def _next_state(spec: SequenceSpec, outputs: dict[str, Any], row: Row, position: int) -> dict[str, Array]:
    """The sequence's state after this step: row `position` of the state outputs (batching)."""
    state: dict[str, Array] = {}
    for entry in spec.states:
        if entry.output_name not in outputs:
            raise InferenceError(
                Status.INTERNAL, f"the model did not produce state output '{entry.output_name}'"
            )
        array = np.asarray(outputs[entry.output_name])
        value = array[position] if spec.batching else array
        if tuple(value.shape) != entry.dims:
            shapes = f"{list(value.shape)}, the config's state dims are {list(entry.dims)}"
            raise InferenceError(Status.INTERNAL, f"state output '{entry.output_name}' has shape {shapes}")
        state[entry.input_name] = np.array(value, dtype=entry.dtype, copy=True)
    return state


def _rows_of(outputs: Mapping[str, Any], count: int) -> None:
    for name, array in outputs.items():
        if np.ndim(array) == 0 or np.shape(array)[0] != count:
            shape = list(np.shape(array))
            message = f"output '{name}' has shape {shape}, expected {count} rows for the batch"
            raise InferenceError(Status.INTERNAL, message)


Result = Arrays | InferenceError
Timing = tuple[int, int, int]


def run_batch(
    spec: SequenceSpec, instance: Instance, rows: list[Row]
) -> tuple[list[Result], list[dict[str, Array] | None], Timing]:
    """(per-row outputs or error, per-row next state (None: unchanged after an error), (start, infer
    start, infer end) monotonic ns). `rows` are sorted by `row`."""
    per_request = getattr(instance, "infer_requests", None)
    if per_request is not None:
        return _run_requests(spec, per_request, rows)
    start_ns = time.monotonic_ns()
    slots: list[Row | None] = _slots(rows) if spec.batching else [rows[0]]
    inputs = _assemble(spec, slots, rows[0].inputs)
    infer_start = time.monotonic_ns()
    outputs = instance.infer(inputs)
    infer_end = time.monotonic_ns()
    if spec.batching:
        _rows_of(outputs, rows[-1].row + 1)
    results: list[Result] = []
    states: list[dict[str, Array] | None] = []
    for row in rows:
        if spec.batching:
            results.append({name: array[row.row : row.row + 1] for name, array in outputs.items()})
        else:
            results.append(dict(outputs))
        states.append(_next_state(spec, outputs, row, row.row))
    return results, states, (start_ns, infer_start, infer_end)


def _info(row: Row | None) -> RequestInfo:
    if row is None:
        return RequestInfo()  # Triton's null request for an empty slot
    flags = (FLAG_SEQUENCE_START if row.start else 0) | (FLAG_SEQUENCE_END if row.end else 0)
    return RequestInfo(row.request_id, row.key[1], flags, row.parameters)


def _run_requests(
    spec: SequenceSpec, per_request: Callable[..., list[Result]], rows: list[Row]
) -> tuple[list[Result], list[dict[str, Array] | None], Timing]:
    """A batch as one request per slot (Python models: Triton's execute(requests)). Each request
    holds exactly its own sequence's row and control values, and each row's answer is the response
    to its own request: a model that reads row 0 of a request, as Triton's Python models do, sees
    its own sequence. Empty Direct slots below the highest used one are null requests (READY=0,
    correlation ID 0), as in Triton, so slot numbers stay put; their responses are dropped."""
    start_ns = time.monotonic_ns()
    slots: list[Row | None] = _slots(rows) if spec.batching else [rows[0]]
    like = rows[0].inputs
    requests = [_assemble(spec, [slot], like) for slot in slots]
    infer_start = time.monotonic_ns()
    responses = per_request(requests, [_info(slot) for slot in slots])
    infer_end = time.monotonic_ns()
    if len(responses) != len(slots):
        raise InferenceError(Status.INTERNAL, f"{len(responses)} responses for {len(slots)} requests")
    results: list[Result] = []
    states: list[dict[str, Array] | None] = []
    for row in rows:
        position = row.row if spec.batching else 0
        response = responses[position]
        try:
            if isinstance(response, InferenceError):
                raise response
            if spec.batching:
                _rows_of(response, 1)
            state = _next_state(spec, response, row, 0)
        except InferenceError as exc:
            results.append(exc)
            states.append(None)
            continue
        results.append(response)
        states.append(state)
    return results, states, (start_ns, infer_start, infer_end)
