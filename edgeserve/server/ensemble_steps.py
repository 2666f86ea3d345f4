"""Helpers of one ensemble step (ensemble.py): the data type a step input is sent as, splitting a
step larger than its model's max_batch_size into chunks and joining their outputs in order, and the
empty outputs of a step given zero rows."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from edgeserve.protocol.errors import internal
from edgeserve.scheduling.job import Arrays
from edgeserve.server import validation


def datatype_of(config: Any, name: str) -> str:
    return validation.compiled(config).inputs[name].datatype


def chunks_of(rows: int, max_batch: int) -> list[tuple[int, int]]:
    if max_batch <= 0:
        return [(0, rows)]
    return [(begin, min(rows, begin + max_batch)) for begin in range(0, rows, max_batch)]


def empty_outputs(config: Any) -> Arrays:
    """Zero-row outputs for a step given zero rows (variable dims are 0)."""
    specs = validation.compiled(config).output_specs
    outputs: Arrays = {}
    for tensor in config.output:
        spec = specs[tensor.name]
        shape = (0, *(max(int(d), 0) for d in tensor.dims))
        outputs[tensor.name] = np.empty(shape, dtype=spec.dtype if spec.dtype is not None else np.object_)
    return outputs


class Gather:
    """Collects the chunks of a step split to fit its model's max_batch_size, in order."""

    def __init__(self, parts: int, done: Callable[[Arrays | BaseException], None]) -> None:
        self._parts: list[Arrays | None] = [None] * parts
        self._left = parts
        self._failed = False
        self._lock = threading.Lock()
        self._done = done

    def callback(self, part: int) -> Callable[[Arrays | BaseException], None]:
        def settle(result: Arrays | BaseException) -> None:
            with self._lock:
                if self._failed:
                    return
                if isinstance(result, BaseException):
                    self._failed = True
                else:
                    self._parts[part] = result
                    self._left -= 1
                    if self._left:
                        return
            if isinstance(result, BaseException):
                self._done(result)
                return
            parts = [p for p in self._parts if p is not None]
            try:
                merged = parts[0] if len(parts) == 1 else {
                    name: np.concatenate([p[name] for p in parts]) for name in parts[0]
                }  # fmt: skip
            except ValueError as exc:
                self._done(internal(f"cannot join the outputs of its {len(parts)} batches: {exc}"))
                return
            self._done(merged)

        return settle
