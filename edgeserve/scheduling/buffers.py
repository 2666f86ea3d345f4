"""Reused input buffers for dynamic batches (issue 36).

A batch of several jobs is gathered into one array per input. A fresh `np.concatenate` allocates it
each time, and from the mmap threshold on (a batch of 8 600 KB frames is 4.8 MB) glibc maps fresh pages
that fault in on the first write and are unmapped after the call: per batch, a page fault per 4 KB.
The pool keeps a few such buffers per input (name, dtype, per-row shape) and gathers into one with
`np.concatenate(out=...)`, so a batch's input is written once into pages that are already there.

A buffer goes back to the pool only when the runtime is done with it: after `infer` returned, and only
when no output shares its memory (a runtime or a Python model may hand back a view of its input; the
outputs reach the clients as row views, so such a buffer is left to them). A failed call drops it.
The pool is bounded in buffers and bytes; `clear` empties it (the scheduler's close, on unload).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgeserve.backends import memory

Arrays = Mapping[str, Any]
Key = tuple[str, str, tuple[int, ...]]
DEFAULT_MAX_BUFFERS = 8


class Lease:
    """The pool's buffers one batch gathered into (given back by `BatchBuffers.release`)."""

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: list[tuple[Key, np.ndarray]] = []


class BatchBuffers:
    """Free gather buffers of one model version, `max_rows` rows each (more when a batch needs it)."""

    def __init__(self, max_rows: int, max_buffers: int = DEFAULT_MAX_BUFFERS,
                 max_bytes: int | None = None) -> None:  # fmt: skip
        self.max_rows = max(1, max_rows)
        self.max_buffers = max_buffers
        self.max_bytes = memory.current().batch_buffer_bytes if max_bytes is None else max_bytes
        self._free: dict[Key, list[np.ndarray]] = {}
        self._count = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made (a steady batch size makes a few, then reuses them)
        self.reused = 0

    @property
    def pooled(self) -> tuple[int, int]:
        """(buffers, bytes) kept free now."""
        return self._count, self._bytes

    def gather(self, batch: Sequence[Arrays]) -> tuple[Arrays, Lease | None]:
        """Each input of the jobs' `batch` concatenated along rows. One job: its own arrays (no copy)."""
        if len(batch) == 1:
            return batch[0], None
        lease = Lease()
        gathered: dict[str, Any] = {}
        for name in batch[0]:
            parts = [np.asarray(inputs[name]) for inputs in batch]
            first = parts[0]
            if first.ndim == 0 or first.dtype.hasobject or any(p.dtype != first.dtype for p in parts):
                gathered[name] = np.concatenate(parts, axis=0)  # strings, odd dtypes: as before
                continue
            rows = sum(p.shape[0] for p in parts)
            key = (name, first.dtype.str, tuple(first.shape[1:]))
            buffer = self._take(key, rows)
            out = buffer[:rows]
            np.concatenate(parts, axis=0, out=out)
            lease.buffers.append((key, buffer))
            gathered[name] = out
        return gathered, lease

    def release(self, lease: Lease | None, outputs: Arrays) -> None:
        """The runtime returned `outputs` for the batch of `lease`: its buffers may serve the next."""
        if lease is None:
            return
        arrays = list(outputs.values())
        for key, buffer in lease.buffers:
            if any(not isinstance(a, np.ndarray) or np.may_share_memory(a, buffer) for a in arrays):
                continue  # an output is (or may be) a view of the input: it stays the clients'
            with self._lock:
                if self._count >= self.max_buffers or self._bytes + buffer.nbytes > self.max_bytes:
                    continue
                self._free.setdefault(key, []).append(buffer)
                self._count += 1
                self._bytes += buffer.nbytes
        lease.buffers.clear()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._count = self._bytes = 0

    def _take(self, key: Key, rows: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(key, [])
            for i, buffer in enumerate(free):
                if buffer.shape[0] >= rows:
                    del free[i]
                    self._count -= 1
                    self._bytes -= buffer.nbytes
                    self.reused += 1
                    return buffer
            self.allocated += 1
        return np.empty((max(rows, self.max_rows), *key[2]), dtype=np.dtype(key[1]))
