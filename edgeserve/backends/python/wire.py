"""What the server and a Python model's worker process say to each other, and how tensors travel.

Control channel: one AF_UNIX stream socket (a socketpair, the worker's end passed as an inherited
fd). A message is a little-endian uint32 length and that many bytes of compact JSON. Only JSON
crosses it: the server never unpickles anything a worker (user code) sends.

Tensors: one shared-memory file per instance (a memfd, passed as an inherited fd; /dev/shm where
memfd_create is missing), mapped by both sides. A call writes its inputs from offset 0; the worker
writes the outputs after them. Each tensor is described in the JSON header as
`{"n": name, "t": datatype, "s": shape, "o": offset, "b": nbytes}`; BYTES tensors are stored in the
protocol's BYTES layout (edgeserve/protocol/datatypes.py). The file grows (to the next power of two)
when a call does not fit; whoever grows it says the new size in its message, and the other side maps
it again. It never shrinks, so its size is the largest call seen.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from edgeserve.protocol import datatypes

if TYPE_CHECKING:
    from edgeserve.backends.base import RequestInfo

Array = npt.NDArray[Any]
Header = dict[str, Any]

ALIGN = 64
MIN_REGION = 1 << 20
MAX_MESSAGE = 64 << 20  # a JSON header larger than this is a broken peer
_LEN = struct.Struct("<I")
_FIRST_READ = 1 << 16


class PeerGone(ConnectionError):
    """The other end closed the control channel (the worker died, or the server went away)."""


def align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


# -- control channel ----------------------------------------------------------------------------
def send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            raise PeerGone("the control channel closed")
        got += n
    return bytes(buffer)


def recv(sock: socket.socket) -> Header:
    """One message. The common case (a message under 64 KiB that arrived whole) is one recv call."""
    first = sock.recv(_FIRST_READ)
    if not first:
        raise PeerGone("the control channel closed")
    if len(first) < _LEN.size:
        first += _recv_exact(sock, _LEN.size - len(first))
    (length,) = _LEN.unpack_from(first)
    if length > MAX_MESSAGE:
        raise PeerGone(f"a control message of {length} bytes (broken peer)")
    body = first[_LEN.size :]
    if len(body) < length:
        body += _recv_exact(sock, length - len(body))
    elif len(body) > length:
        raise PeerGone("a control message longer than its length (broken peer)")
    message = json.loads(body)
    if not isinstance(message, dict):
        raise PeerGone("a control message that is not a JSON object")
    return message


# Request parameters Triton turns into request fields (not part of request.parameters()).
_NOT_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})
# The models a BLS call came through ("a,b"), as the calling instance sets it on the request: a
# call into a model already on the chain whose instances are all busy would wait forever.
CHAIN_PARAMETER = "edgeserve_bls_chain"


def request_entry(info: RequestInfo | None) -> Header:
    """The JSON fields of one request of an execute call, besides its tensors."""
    if info is None:
        return {"id": "", "params": "{}", "corrid": 0, "flags": 0}
    params = {
        k: v for k, v in info.parameters.items()
        if k not in _NOT_PARAMETERS and k != CHAIN_PARAMETER and not k.startswith("triton_")
    }  # fmt: skip
    entry: Header = {"id": info.request_id, "params": json.dumps(params, default=str),
                     "corrid": info.correlation_id, "flags": info.flags}  # fmt: skip
    chain = info.parameters.get(CHAIN_PARAMETER)
    if isinstance(chain, str) and chain:
        entry["chain"] = chain
    return entry


# -- shared memory ------------------------------------------------------------------------------
def create_region_fd(label: str, size: int = MIN_REGION) -> int:
    """A new shared-memory file of `size` bytes (close-on-exec; pass it with `pass_fds`), sealed
    against shrinking: the worker (user code) holds it too, and a file cut under the server's views
    would fault the server (SIGBUS) instead of failing a call."""
    try:
        fd = os.memfd_create(f"edgeserve-py-{label}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):  # pragma: no cover - kernels without memfd
        import tempfile  # here only: the worker imports this module, and tempfile costs it ~1 MB

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="edgeserve-py-", dir=folder)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    with contextlib.suppress(AttributeError, OSError):  # a /dev/shm file cannot be sealed
        import fcntl  # here only: the worker never creates a region

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


class Region:
    """One side's mapping of the shared file. Not thread-safe: one call at a time."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size)

    @property
    def buffer(self) -> mmap.mmap:
        return self._map

    def follow(self, size: int) -> None:
        """The peer grew the file to `size`: map it again (old views stay valid until released)."""
        if size > self.size:
            self.size = size
            self._map = mmap.mmap(self.fd, size)  # the old map is unmapped when its last view goes

    def reserve(self, end: int) -> None:
        """Make the file at least `end` bytes long (next power of two)."""
        if end <= self.size:
            return
        size = max(MIN_REGION, 1 << (end - 1).bit_length())
        os.ftruncate(self.fd, size)
        self.follow(size)

    def discard(self, start: int) -> None:
        """Hand the file's pages from `start` on back to the system (on both sides: a shared file's
        pages); its size stays, and the next call that writes there faults fresh pages in."""
        start = -(-max(0, start) // mmap.PAGESIZE) * mmap.PAGESIZE
        if start >= self.size:
            return
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no MADV_REMOVE: keep the pages
            self._map.madvise(mmap.MADV_REMOVE, start, self.size - start)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # views still exported: unmapped when they go
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _encoded(array: Array, datatype: str) -> tuple[bytes | None, int]:
    if datatype == "BYTES":
        data = datatypes.serialize_bytes(array)
        return data, len(data)
    return None, int(array.nbytes)


Prepared = list[tuple[str, Array, str, "bytes | None", int]]


def prepare_tensors(tensors: Iterable[tuple[str, Array]]) -> tuple[Prepared, int]:
    """The tensors as they will be written (BYTES serialized once) and the bytes they need from an
    aligned start."""
    prepared: Prepared = []
    size = 0
    for name, value in tensors:
        array = np.asarray(value)
        datatype = datatypes.from_numpy(array.dtype)
        data, nbytes = _encoded(array, datatype)
        prepared.append((name, array, datatype, data, nbytes))
        size = align(size) + nbytes
    return prepared, size


def write_prepared(buffer: Any, prepared: Prepared, start: int) -> list[Header]:
    """Copy prepared tensors into `buffer` from `start` (aligned; one copy each); their descriptors."""
    headers: list[Header] = []
    offset = align(start)
    for name, array, datatype, data, nbytes in prepared:
        offset = align(offset)
        if data is not None:
            buffer[offset : offset + nbytes] = data
        elif nbytes:
            target: Array = np.ndarray(array.shape, dtype=array.dtype, buffer=buffer, offset=offset)
            np.copyto(target, array, casting="no")
        headers.append({"n": name, "t": datatype, "s": list(array.shape), "o": offset, "b": nbytes})
        offset += nbytes
    return headers


def write_tensors(
    region: Region, tensors: Iterable[tuple[str, Array]], start: int
) -> tuple[list[Header], int]:
    """Copy `tensors` into the region from `start` (one copy each); their descriptors and the end."""
    prepared, size = prepare_tensors(tensors)
    end = align(start) + size
    region.reserve(end)
    return write_prepared(region.buffer, prepared, start), end


def read_tensor(region: Region, header: Mapping[str, Any], copy: bool) -> Array:
    """The tensor a descriptor names: a view into the region, or a copy of it (`copy`)."""
    name, datatype = str(header["n"]), str(header["t"])
    shape = tuple(int(d) for d in header["s"])
    offset, nbytes = int(header["o"]), int(header["b"])
    if offset < 0 or nbytes < 0 or offset + nbytes > region.size:
        raise ValueError(
            f"tensor '{name}' lies outside the shared memory ({offset}+{nbytes} > {region.size})"
        )
    view = memoryview(region.buffer)[offset : offset + nbytes]
    try:
        if datatype == "BYTES":
            return datatypes.deserialize_bytes(
                view, datatypes.element_count(shape), f"tensor '{name}'"
            ).reshape(shape)
        array = datatypes.from_buffer(view, datatype, shape, f"tensor '{name}'")
        return array.copy() if copy else array
    finally:
        if copy or datatype == "BYTES":
            view.release()
