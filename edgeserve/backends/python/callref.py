"""BLS inputs passed by reference: a tensor a model got in the current execute call and passes on to
`InferenceRequest(...).exec()` unchanged is already in shared memory (the per-call region, wire.py),
so the worker names it (`"r": "call"`, offset and size in that region) instead of copying it into
its half of the event channel; the server reads it in place, read-only.

Worker side (`CallRegion`): a reference is sent only while a non-decoupled execute call runs (the
server writes the region only between calls), for a C-contiguous view that lies inside the current
mapping, and the call is pinned: the execute reply (after which the server reuses the region) waits
until every pinned call has its answer, also one a model's own thread or task started and did not
wait for. A decoupled model's execute may return while its work runs: its inputs are copies (not
views), so its BLS inputs are copied as before; so are a decoupled BLS call's (its answers may come
long after).

Server side (`resolve`): the worker runs user code, so every reference is checked (region, bounds,
size against shape and datatype); a bad one is the caller's INVALID_ARG, never a read outside the
region. The region's file is sealed against shrinking (wire.create_region_fd): a view never faults.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgeserve.backends.python import wire
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status

CALL = "call"  # the only region a reference may name: the per-call region of the caller's instance


class CallRegion:
    """The worker's per-call region as its BLS calls may name it."""

    def __init__(self, region: wire.Region) -> None:
        self.region = region
        self._cond = threading.Condition()
        self._live = False
        self._pins = 0
        self._mapped: Any = None  # the mapping `_base` is the address of
        self._base = 0

    def open(self) -> None:
        """A non-decoupled execute call starts: its inputs may be passed on by reference."""
        with self._cond:
            self._live = True

    def close(self) -> None:
        """The execute call returned: wait for the pinned calls, then no more references."""
        with self._cond:
            self._live = False
            while self._pins:
                self._cond.wait()

    def pin(self, array: Any) -> tuple[int, int] | None:
        """(offset, nbytes) of `array` in the region, pinned until `unpin`; None: copy it."""
        if not isinstance(array, np.ndarray) or array.dtype.hasobject or array.nbytes == 0:
            return None
        if not array.flags.c_contiguous:
            return None
        with self._cond:
            if not self._live:
                return None
            mapped = self.region.buffer
            if mapped is not self._mapped:  # grown and mapped again: the old views are not in it
                whole = np.frombuffer(mapped, np.uint8)
                self._base, self._mapped = int(whole.__array_interface__["data"][0]), mapped
                del whole  # its export would keep the mapping from being closed
            offset = int(array.__array_interface__["data"][0]) - self._base
            if offset < 0 or offset + array.nbytes > self.region.size:
                return None
            self._pins += 1
        return offset, int(array.nbytes)

    def unpin(self) -> None:
        with self._cond:
            self._pins -= 1
            self._cond.notify_all()


def is_reference(header: Mapping[str, Any]) -> bool:
    return "r" in header


def resolve(region: wire.Region | None, header: Mapping[str, Any]) -> wire.Array:
    """The read-only view a worker's reference names. InferenceError INVALID_ARG when it is bad."""
    name = str(header.get("n"))
    try:
        if header.get("r") != CALL or region is None:
            raise ValueError(f"names no region this worker has ({header.get('r')!r})")
        offset, nbytes = header["o"], header["b"]
        if type(offset) is not int or type(nbytes) is not int:  # bool too: JSON's true is no offset
            raise ValueError("a reference's offset and size must be integers")
        if offset < 0 or nbytes < 0 or offset + nbytes > region.size:
            raise ValueError(f"lies outside the caller's shared memory ({offset}+{nbytes} > {region.size})")
        datatype = str(header["t"])
        if datatype == "BYTES" or not datatypes.is_known(datatype):
            raise ValueError(f"a reference to a {datatype} tensor")
        shape = tuple(int(d) for d in header["s"])
        if any(d < 0 for d in shape):
            raise ValueError(f"a negative dimension in {list(shape)}")
        view = memoryview(region.buffer)[offset : offset + nbytes]
        array = datatypes.from_buffer(view, datatype, shape, f"BLS input '{name}'")
    except InferenceError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise InferenceError(Status.INVALID_ARG, f"BLS input '{name}': {exc}") from None
    array.flags.writeable = False  # the caller's input: the called model reads it, never writes it
    return array
