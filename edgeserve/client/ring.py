"""Producer side of the shared-memory frame ring: N fixed-size slots in one shared-memory segment.

The ring is created and owned by this process: a memfd sealed against shrinking (F_SEAL_SHRINK,
F_SEAL_GROW), registered by ``memfd:<name>:<pid>:<fd>``. The seal is what lets the server read the
frames in place (zero copy) without trusting this process: nobody can truncate the memory under it.
With `sealed=False` (or where memfds are unavailable) the ring is a POSIX segment in /dev/shm,
which the server reads with one copy instead. If this process dies, its memory goes when the server
releases the registration (it does when it sees the client go). Typical use, zero-copy from the
camera into the slot:

    ring = client.create_ring(slots=8, slot_size=480 * 640 * 3)
    slot = ring.acquire()                      # RingFull if all 8 are in flight: drop the frame
    frame = slot.ndarray((1, 480, 640, 3), np.uint8)
    camera.read_into(frame)                    # or: slot.write(array) to copy one in
    future = client.submit("detector", {"images": slot.tensor((1, 480, 640, 3), np.uint8)})

A slot named by a request goes back to its ring when that request's reply (or error) arrives.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.client.errors import ClientError, RingFull
from edgeserve.frontends.shm.ring import GEN_OFFSET, HEADER_SIZE, RingLayout
from edgeserve.protocol import datatypes


@dataclass(frozen=True, slots=True)
class ShmTensor:
    """A tensor in shared memory, named in a request instead of sent inline.

    For inputs, `datatype` and `shape` are required. `slot` makes it a ring-slot reference
    (`offset` is then relative to the slot). For plain regions, `offset` is relative to the region.
    """

    region: str
    byte_size: int
    offset: int = 0
    datatype: str | None = None
    shape: tuple[int, ...] | None = None
    slot: Slot | None = None


# Per-call lookups memoised (they cost microseconds on the hot path); bounded so odd callers
# cannot grow them without limit.
_CACHE_MAX = 512
_DATATYPE_OF: dict[Any, str] = {}
_TENSOR_SPEC: dict[tuple[Any, str], tuple[tuple[int, ...], int]] = {}


def _datatype(dtype: Any) -> str:
    try:
        return _DATATYPE_OF[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype spec
        pass
    if isinstance(dtype, str) and datatypes.is_known(dtype):
        datatype = dtype
    else:
        datatype = datatypes.from_numpy(np.dtype(dtype))
    if len(_DATATYPE_OF) < _CACHE_MAX:
        with contextlib.suppress(TypeError):
            _DATATYPE_OF[dtype] = datatype
    return datatype


def _tensor_spec(shape: Any, datatype: str) -> tuple[tuple[int, ...], int]:
    """(shape as a tuple of ints, byte size) of a fixed-size tensor."""
    try:
        return _TENSOR_SPEC[shape, datatype]
    except (KeyError, TypeError):  # TypeError: a list shape
        pass
    spec = (
        tuple(int(d) for d in shape),
        int(datatypes.element_count(shape) * datatypes.element_size(datatype)),
    )
    # Only all-int tuples: an equal key of floats or numpy ints then maps to the same ints.
    if type(shape) is tuple and len(_TENSOR_SPEC) < _CACHE_MAX and all(type(d) is int for d in shape):
        _TENSOR_SPEC[shape, datatype] = spec
    return spec


class Slot:
    """One slot taken from a ring for one frame; `gen` is the generation every reference carries."""

    __slots__ = ("gen", "index", "ring")

    def __init__(self, ring: FrameRing, index: int, gen: int) -> None:
        self.ring = ring
        self.index = index
        self.gen = gen

    @property
    def buffer(self) -> memoryview:
        """The slot's bytes (writable)."""
        start = self.ring.layout.slot_offset(self.index)
        return self.ring.buf[start : start + self.ring.slot_size]

    def ndarray(self, shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
        """A writable numpy view of the slot's first bytes, to fill in place (zero copy)."""
        dt = datatypes.numpy_dtype(_datatype(dtype))
        count = datatypes.element_count(shape)
        if count * dt.itemsize > self.ring.slot_size:
            raise ValueError(
                f"{list(shape)} {dt} needs {count * dt.itemsize} bytes; slots hold {self.ring.slot_size}"
            )
        return np.frombuffer(self.buffer, dtype=dt, count=count).reshape(shape)

    def tensor(self, shape: tuple[int, ...], dtype: Any, byte_size: int | None = None) -> ShmTensor:
        """A reference to what was written with `ndarray()` (an input of a request)."""
        datatype = _datatype(dtype)
        if byte_size is None:
            dims, byte_size = _tensor_spec(shape, datatype)
        else:
            dims = tuple(int(d) for d in shape)
        return ShmTensor(self.ring.name, byte_size, 0, datatype, dims, self)

    def write(self, array: npt.NDArray[Any]) -> ShmTensor:
        """Copy `array` into the slot and return its reference: one copy, straight into the slot
        (a strided view, such as a crop of a camera frame, is gathered by that same copy)."""
        array = np.asarray(array)
        datatype = _datatype(array.dtype)
        shape = array.shape
        if datatype == "BYTES":
            payload = datatypes.to_wire_bytes(array, datatype)
            size = memoryview(payload).nbytes
            self.ring.check_fits(size)
            self.buffer[:size] = payload
            return ShmTensor(self.ring.name, size, 0, datatype, shape, self)
        size = array.nbytes
        np.copyto(self.ring._target(self.index, array.dtype, shape, size), array, casting="no")
        return ShmTensor(self.ring.name, size, 0, datatype, shape, self)

    def output(self, byte_size: int | None = None) -> ShmTensor:
        """A reference asking the server to write an output into this slot."""
        return ShmTensor(
            self.ring.name, self.ring.slot_size if byte_size is None else byte_size, 0, slot=self
        )

    def release(self) -> None:
        self.ring.release(self)

    def __repr__(self) -> str:
        return f"Slot({self.ring.name!r}, index={self.index}, gen={self.gen})"


class FrameRing:
    """`slots` slots of `slot_size` bytes in new shared memory owned by this process.

    `sealed` (default): a memfd sealed against resizing, registered as ``memfd:<name>:<pid>:<fd>``
    (the server reads it in place). `sealed=False`, or a `key`: a POSIX segment `/dev/shm/<key>`
    (the server copies each frame out of it once)."""

    def __init__(
        self,
        slots: int,
        slot_size: int,
        *,
        name: str | None = None,
        key: str | None = None,
        sealed: bool = True,
    ) -> None:
        self.layout = RingLayout.plan(slots, slot_size)
        base = f"edgeserve-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        self._fd = -1
        if sealed and key is None and hasattr(os, "memfd_create"):
            self._fd = os.memfd_create(base, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self._fd, self.layout.total_size)
                fcntl.fcntl(
                    self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                )
                self._map = mmap.mmap(self._fd, self.layout.total_size)
            except BaseException:
                os.close(self._fd)
                raise
            self.key = f"memfd:{base}:{os.getpid()}:{self._fd}"
            self.name = name or base  # the region name on the server
            self.buf: memoryview = memoryview(self._map)
        else:
            self.key = (key or base).lstrip("/")
            self.name = name or self.key
            self._shm = shared_memory.SharedMemory(name=self.key, create=True, size=self.layout.total_size)
            assert self._shm.buf is not None
            self.buf = self._shm.buf
        self.buf[:HEADER_SIZE] = self.layout.header_bytes()
        self._gens: npt.NDArray[np.uint64] = np.ndarray(
            (slots,), dtype="<u8", buffer=self.buf, offset=GEN_OFFSET
        )
        self._gens[:] = 0
        # Free slots, the most recently released last: taken first, its memory is likely still in
        # this core's cache (copying a 600 KB frame into a cold slot took twice as long here).
        self._free: list[int] = list(range(slots - 1, -1, -1))
        # Typed views of slots that `Slot.write` fills, by (slot, dtype, shape): made once, not per frame.
        self._targets: dict[tuple[int, Any, tuple[int, ...]], npt.NDArray[Any]] = {}
        self._stale: dict[int, None] = {}  # timed-out slots, oldest first: reused last
        self._taken: set[int] = set()
        self._lock = threading.Lock()
        self.closed = False

    @property
    def sealed(self) -> bool:
        """True for a sealed memfd ring (the server reads its slots in place)."""
        return self._map is not None

    @property
    def slots(self) -> int:
        return self.layout.slots

    @property
    def slot_size(self) -> int:
        return self.layout.slot_size

    @property
    def byte_size(self) -> int:
        return self.layout.total_size

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free) + len(self._stale)

    def generation(self, index: int) -> int:
        return int(self._gens[index])

    def try_acquire(self) -> Slot | None:
        """A free slot with a new generation, or None when every slot is in flight."""
        with self._lock:
            if self.closed:
                raise ClientError("UNAVAILABLE", f"ring '{self.name}' is closed")
            if self._free:
                index = self._free.pop()
            elif self._stale:  # a request that timed out may still be using it: bumping the
                index = next(iter(self._stale))  # generation makes the server refuse it
                del self._stale[index]
            else:
                return None
            gen = int(self._gens[index]) + 1
            self._gens[index] = gen
            self._taken.add(index)
        return Slot(self, index, gen)

    def acquire(self) -> Slot:
        slot = self.try_acquire()
        if slot is None:
            raise RingFull(
                f"all {self.slots} slots of ring '{self.name}' are in flight; drop this frame "
                "or wait for a result"
            )
        return slot

    def release(self, slot: Slot) -> None:
        """Give a slot back (idempotent; a slot whose generation moved on is ignored)."""
        with self._lock:
            index = slot.index
            if index not in self._taken and index not in self._stale:  # free already, or not ours
                return
            if int(self._gens[index]) != slot.gen:  # reused since: the newer owner releases it
                return
            self._taken.discard(index)
            self._stale.pop(index, None)  # the late answer of a call that timed out
            self._free.append(index)

    def check_fits(self, size: int) -> None:
        if size > self.slot_size:
            raise ClientError(
                "INVALID_ARG",
                f"a {size}-byte tensor does not fit a {self.slot_size}-byte slot of ring '{self.name}'",
            )

    def _target(self, index: int, dtype: Any, shape: tuple[int, ...], size: int) -> npt.NDArray[Any]:
        """A writable `dtype` view of `shape` at the start of slot `index` (`size` bytes, checked)."""
        key = (index, dtype, shape)
        target = self._targets.get(key)
        if target is None:
            self.check_fits(size)
            if self.closed:
                raise ClientError("UNAVAILABLE", f"ring '{self.name}' is closed")
            # Viewing as uint8 first also covers dtypes the buffer protocol cannot export (bfloat16).
            start = self.layout.slot_offset(index)
            raw = np.frombuffer(self.buf, dtype=np.uint8, count=size, offset=start)
            target = raw.view(dtype).reshape(shape)
            if len(self._targets) >= _CACHE_MAX:
                self._targets.clear()
            self._targets[key] = target
        return target

    def quarantine(self, slot: Slot) -> None:
        """A request using this slot timed out: reuse the slot only when no other is free."""
        with self._lock:
            if slot.index in self._taken and int(self._gens[slot.index]) == slot.gen:
                self._taken.discard(slot.index)
                self._stale[slot.index] = None

    def read(
        self, slot: Slot, datatype: str, shape: tuple[int, ...], byte_size: int, copy: bool = True
    ) -> npt.NDArray[Any]:
        """A tensor the server wrote into `slot`: a copy, or (`copy=False`) a view that is valid
        only while the slot is held."""
        start = self.layout.slot_offset(slot.index)
        if byte_size > self.slot_size:
            raise ClientError(
                "INTERNAL", f"server reported {byte_size} bytes in a {self.slot_size}-byte slot"
            )
        view = self.buf[start : start + byte_size]
        array = datatypes.from_buffer(view, datatype, shape, f"ring '{self.name}' slot {slot.index}")
        return np.array(array) if copy else array

    def close(self) -> None:
        """Let the memory go: close the memfd / unlink the segment (the server keeps its own
        reference until it unregisters the region)."""
        if self.closed:
            return
        self.closed = True
        del self._gens
        self._targets.clear()  # views of the mapping: it cannot be unmapped while they exist
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            with contextlib.suppress(BufferError):  # a caller still holds a slot view: unmapped at exit
                self._shm.close()
            return
        with contextlib.suppress(BufferError):
            self.buf.release()
        with contextlib.suppress(BufferError):  # a caller still holds a slot view: unmapped at exit
            assert self._map is not None
            self._map.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> FrameRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FrameRing({self.name!r}, slots={self.slots}, slot_size={self.slot_size})"
