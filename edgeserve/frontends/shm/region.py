"""A registered shared-memory region and the lease a request holds on it (see registry.py).

A region is mapped only when sealed against shrinking; any other is an open file read with `pread`
and written with `pwrite` after a size check, so a client truncating its file gets an error, never a
SIGBUS in the server. A region registered by a client that may only read the memory takes no outputs.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from edgeserve.frontends.shm.binding import IN_PROCESS
from edgeserve.protocol.errors import InferenceError, Status, invalid_arg

log = logging.getLogger("edgeserve.shm")


@dataclass(frozen=True, slots=True)
class RegionInfo:
    name: str
    key: str
    offset: int
    byte_size: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class Region:
    """A registered region: mapped when sealed against shrinking, else only an open file."""

    __slots__ = ("fd", "info", "map", "owner", "principal", "refs", "retired", "writable")

    def __init__(
        self,
        info: RegionInfo,
        fd: int,
        mapping: mmap.mmap | None,
        owner: str,
        writable: bool = True,
        principal: str = IN_PROCESS,
    ) -> None:
        self.info = info
        self.fd = fd  # -1 for a mapped (sealed) region: the mapping keeps the memory alive
        self.map = mapping
        self.owner = owner  # "" for Triton-protocol regions; a client id for ZMQ rings
        self.refs = 0
        self.retired = False
        self.writable = writable  # False: the client that registered it may only read it
        self.principal = principal  # who may name it (binding.py)

    def check_writable(self, what: str) -> None:
        if not self.writable:
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"shared memory region '{self.info.name}': {what} cannot be written there; the client "
                f"that registered key '{self.info.key}' may only read it",
            )

    @property
    def sealed(self) -> bool:
        return self.map is not None

    def unmap(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                # A numpy view still points into it; the mapping goes when the last view does.
                log.debug("region %s still has live views; unmapped on release", self.info.name)

    def truncated(self, start: int, size: int, have: int, what: str) -> InferenceError:
        return invalid_arg(
            f"shared memory region '{self.info.name}' (key '{self.info.key}') was truncated by its owner: "
            f"{what} needs bytes {start - self.info.offset}..{start - self.info.offset + size} of the region "
            f"(file offset {start}, {size} bytes) but the file now holds {have} bytes"
        )

    def pread(self, start: int, size: int) -> bytes:
        """`size` bytes at file offset `start`, copied: never a fault, whatever the client does."""
        try:
            data = os.pread(self.fd, size, start)
            while len(data) < size:  # tmpfs returns everything at once; other files may not
                more = os.pread(self.fd, size - len(data), start + len(data))
                if not more:
                    break
                data += more
        except OSError as exc:
            raise invalid_arg(
                f"shared memory region '{self.info.name}' could not be read ({exc.strerror})"
            ) from None
        if len(data) < size:
            raise self.truncated(start, size, os.fstat(self.fd).st_size, "the request")
        return data

    def pwrite(self, start: int, payload: Any, what: str) -> None:
        """Write `payload` at file offset `start`, only within the file's current size (a pwrite
        past the end would grow the client's file; a truncate racing this check only hurts its owner)."""
        self.check_writable(what)
        data = memoryview(payload).cast("B")
        have = os.fstat(self.fd).st_size
        if start + data.nbytes > have:
            raise self.truncated(start, data.nbytes, have, what)
        try:
            done = 0
            while done < data.nbytes:
                written = os.pwrite(self.fd, data[done:], start + done)
                if written <= 0:
                    raise OSError(errno.EIO, "short write")
                done += written
        except OSError as exc:
            raise invalid_arg(
                f"shared memory region '{self.info.name}': {what} could not be written ({exc.strerror})"
            ) from None


class _WriteThrough(bytearray):
    """A copy of a lease's bytes whose slice assignments are also written to the client's file.

    What `ShmLease.view` gives for a region that is not mapped, so code written against a mapped
    view (`GEN.unpack_from(lease.view, at)`, `lease.view[:n] = payload`) stays correct and safe:
    every `view` access reads the bytes afresh."""

    __slots__ = ("_region", "_start")

    def __init__(self, data: bytes, region: Region, start: int) -> None:
        super().__init__(data)
        self._region = region
        self._start = start

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, slice):
            raise TypeError("a shared memory view takes slice assignments only")
        lo, hi, step = key.indices(len(self))
        data = memoryview(value).cast("B")
        if step != 1 or data.nbytes != hi - lo:
            raise ValueError("a shared memory view takes contiguous, same-size slice assignments only")
        self._region.pwrite(self._start + lo, data, "the output")
        super().__setitem__(key, data)

    @property
    def nbytes(self) -> int:
        return len(self)


class ShmLease:
    """A region kept open for one request, bounded to exactly the referenced bytes.

    `read()` gives the bytes (a zero-copy view of a sealed region, else one copy made with `pread`),
    `write(payload)` stores an output. `view`: the referenced bytes as a buffer (mapped when sealed,
    else a fresh copy whose slice assignments write through). `release(region)`: the registry's, which
    unmaps a retired region when its last lease goes."""

    __slots__ = ("_region", "_release", "_size", "_start", "_view")

    def __init__(
        self,
        release: Callable[[Region], None],
        region: Region,
        start: int,
        size: int,
        view: memoryview | None,
    ) -> None:
        self._release = release
        self._region = region
        self._start = start  # file offset of the first referenced byte
        self._size = size
        self._view = view  # only for a mapped (sealed) region

    @property
    def sealed(self) -> bool:
        return self._view is not None

    @property
    def nbytes(self) -> int:
        return self._size

    @property
    def view(self) -> Any:
        if self._view is not None:
            return self._view
        region = self._region
        if region is None:
            return memoryview(b"")
        return _WriteThrough(region.pread(self._start, self._size), region, self._start)

    def read(self) -> memoryview | bytes:
        """The referenced bytes: the mapping itself when sealed (zero copy), else a copy."""
        if self._view is not None:
            return self._view
        if self._region is None:
            return b""
        return self._region.pread(self._start, self._size)

    def mapped(self, start: int, size: int) -> memoryview | None:
        """Bytes `start`..`start + size` of the whole region (not only the referenced ones), kept open
        by this lease: a view of a sealed region's mapping, checked against the region's size as a
        lease of their own would be; None for a region that is not mapped (read it with a lease)."""
        region = self._region
        if self._view is None or region is None or region.map is None:
            return None
        limit = region.info.byte_size
        if start < 0 or size < 0 or start + size > limit:
            raise invalid_arg(
                f"Invalid offset + byte size ({start} + {size}) for shared memory region "
                f"'{region.info.name}' of {limit} bytes"
            )
        at = region.info.offset + start
        return memoryview(region.map)[at : at + size]

    def write(self, payload: Any, what: str = "the output") -> None:
        """Store `payload` (at most `nbytes`) at the start of the referenced bytes."""
        size = memoryview(payload).nbytes
        if size > self._size:
            raise invalid_arg(f"{what}: {size} bytes do not fit the {self._size} referenced bytes")
        if self._view is not None:
            if self._region is not None:
                self._region.check_writable(what)
            self._view[:size] = payload
        elif self._region is not None:
            self._region.pwrite(self._start, payload, what)

    def release(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None  # type: ignore[assignment]
            if self._view is not None:
                self._view = memoryview(b"")
            self._release(region)

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
