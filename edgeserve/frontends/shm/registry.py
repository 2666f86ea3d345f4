"""Registry of client-owned POSIX shared-memory regions, shared by every frontend.

A region is opened by key without taking ownership: never `multiprocessing.shared_memory`
(its resource tracker would unlink the client's segment) and never unlink. Leases keep a region
mapped while requests use it, so unregistering during in-flight requests is safe.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from edgeserve.protocol.errors import InferenceError, Status, invalid_arg, not_found
from edgeserve.protocol.inference import ShmRef

log = logging.getLogger("edgeserve.shm")

SHM_DIR = "/dev/shm"
# Owner of regions registered over the Triton protocol (HTTP/gRPC); ZMQ rings are owned by their client,
# so a Triton "unregister all" leaves the camera rings of ZMQ producers alone.
TRITON_OWNER = ""
_RESERVED_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True, slots=True)
class RegionInfo:
    name: str
    key: str
    offset: int
    byte_size: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class _Region:
    __slots__ = ("info", "map", "owner", "refs", "retired")

    def __init__(self, info: RegionInfo, mapping: mmap.mmap, owner: str) -> None:
        self.info = info
        self.map = mapping
        self.owner = owner  # "" for Triton-protocol regions; a client id for ZMQ rings
        self.refs = 0
        self.retired = False

    def unmap(self) -> None:
        try:
            self.map.close()
        except BufferError:
            # A numpy view still points into it; the mapping goes when the last view does.
            log.debug("region %s still has live views; unmapped on release", self.info.name)


class ShmLease:
    """A region kept mapped for one request; `view` is exactly the referenced bytes."""

    __slots__ = ("_region", "_registry", "view")

    def __init__(self, registry: SharedMemoryRegistry, region: _Region, view: memoryview) -> None:
        self._registry = registry
        self._region = region
        self.view = view

    def release(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None  # type: ignore[assignment]
            self.view = memoryview(b"")
            self._registry._release(region)

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _key_path(key: str) -> str:
    stripped = key.lstrip("/")
    if not stripped:
        raise invalid_arg(f"shared memory key '{key}' is empty or only slashes")
    if "/" in stripped or stripped in (".", ".."):
        raise invalid_arg(f"shared memory key '{key}' must name one object in {SHM_DIR}")
    if stripped.startswith(_RESERVED_PREFIX):
        raise invalid_arg(f"shared memory key '{key}' uses a reserved prefix")
    return os.path.join(SHM_DIR, stripped)


class SharedMemoryRegistry:
    def __init__(
        self, allow_client_shm: bool = True, key_prefixes: list[str] | None = None, max_regions: int = 1024
    ) -> None:
        self.allow_client_shm = allow_client_shm
        self.key_prefixes = [p.lstrip("/") for p in (key_prefixes or [])]
        self.max_regions = max_regions
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int, owner: str = "") -> None:
        if not self.allow_client_shm:
            raise InferenceError(
                Status.UNSUPPORTED,
                "Client shared memory is disabled. Set [shm] allow_client_shm = true to enable.",
            )
        if not name:
            raise invalid_arg("shared memory region name must not be empty")
        if offset < 0 or byte_size <= 0:
            raise invalid_arg(
                f"failed to register shared memory region '{name}': offset must be >= 0 and byte_size > 0"
            )
        path = _key_path(key)
        if self.key_prefixes and not any(key.lstrip("/").startswith(p) for p in self.key_prefixes):
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"shared memory key '{key}' is not allowed here; allowed prefixes: {self.key_prefixes}",
            )
        with self._lock:
            if name in self._regions:
                raise InferenceError(
                    Status.ALREADY_EXISTS, f"shared memory region '{name}' already in manager"
                )
            if len(self._regions) >= self.max_regions:
                raise InferenceError(
                    Status.RESOURCE_EXHAUSTED, f"too many shared memory regions (max {self.max_regions})"
                )
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise InferenceError(
                Status.INTERNAL, f"Unable to open shared memory region: '{key}' ({exc.strerror})"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise invalid_arg(
                    f"failed to register shared memory region '{name}': offset {offset} + byte_size "
                    f"{byte_size} is past the end of '{key}' ({size} bytes)"
                )
            mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        region = _Region(RegionInfo(name, key, offset, byte_size), mapping, owner)
        with self._lock:
            if name in self._regions:  # lost a race with another register of the same name
                mapping.close()
                raise InferenceError(
                    Status.ALREADY_EXISTS, f"shared memory region '{name}' already in manager"
                )
            self._regions[name] = region
        log.info("shm region registered name=%s key=%s offset=%d size=%d", name, key, offset, byte_size)

    def unregister(self, name: str = "", owner: str | None = None) -> None:
        """Unknown names are silently fine (Triton); "" removes every region (of `owner`, if given).

        With both a name and an `owner`, only that owner's region may go: PERMISSION_DENIED otherwise.
        """
        with self._lock:
            if name:
                found = self._regions.get(name)
                if found is not None and owner is not None and found.owner != owner:
                    raise InferenceError(
                        Status.PERMISSION_DENIED,
                        f"shared memory region '{name}' was registered by another client; only its owner "
                        "(or the gRPC/HTTP system shared memory API) can unregister it",
                    )
                names = [name] if found is not None else []
            else:
                names = [n for n, r in self._regions.items() if owner is None or r.owner == owner]
            retired = [self._regions.pop(n) for n in names]
            for region in retired:
                region.retired = True
            to_unmap = [r for r in retired if r.refs == 0]
        for region in to_unmap:
            region.unmap()
        for region in retired:
            log.info("shm region unregistered name=%s in_flight=%d", region.info.name, region.refs)

    def status(self, name: str = "", owner: str | None = None) -> list[RegionInfo]:
        """Regions (of `owner`, if given: the Triton-protocol APIs list only their own)."""
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None or (owner is not None and region.owner != owner):
                    raise not_found(f"Unable to find system shared memory region: '{name}'")
                return [region.info]
            return [r.info for r in self._regions.values() if owner is None or r.owner == owner]

    def unregister_triton(self, name: str = "") -> None:
        """Triton-protocol unregister: its own regions only; another client's ZMQ ring is left alone
        (silently, as Triton treats unknown names)."""
        if name and name not in self.names(owner=TRITON_OWNER):
            return
        self.unregister(name, owner=TRITON_OWNER)

    def names(self, owner: str | None = None) -> list[str]:
        with self._lock:
            return [n for n, r in self._regions.items() if owner is None or r.owner == owner]

    # -- use ------------------------------------------------------------------------------------
    def acquire(self, ref: ShmRef) -> ShmLease:
        """Map `ref` for one request, with every bound checked."""
        with self._lock:
            region = self._regions.get(ref.region)
            if region is None:
                raise not_found(f"Unable to find shared memory region: '{ref.region}'")
            size = region.info.byte_size
            if ref.offset < 0 or ref.byte_size < 0:
                raise invalid_arg(f"shared memory region '{ref.region}': negative offset or byte size")
            if ref.offset >= size and not (ref.offset == size and ref.byte_size == 0):
                raise invalid_arg(
                    f"Invalid offset {ref.offset} for shared memory region '{ref.region}' of {size} bytes"
                )
            if ref.offset + ref.byte_size > size:
                raise invalid_arg(
                    f"Invalid offset + byte size ({ref.offset} + {ref.byte_size}) for shared memory region "
                    f"'{ref.region}' of {size} bytes"
                )
            region.refs += 1
        start = region.info.offset + ref.offset
        view = memoryview(region.map)[start : start + ref.byte_size]
        return ShmLease(self, region, view)

    def _release(self, region: _Region) -> None:
        with self._lock:
            region.refs -= 1
            unmap = region.retired and region.refs == 0
        if unmap:
            region.unmap()

    def close(self) -> None:
        self.unregister("")
