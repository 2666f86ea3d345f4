"""Registry of client-owned shared-memory regions, shared by every frontend.

A region is opened by key without taking ownership: never `multiprocessing.shared_memory`
(its resource tracker would unlink the client's segment) and never unlink. Leases keep a region
open while requests use it, so unregistering during in-flight requests is safe.

Shared memory a client controls is hostile input: the client can `ftruncate` the file under the
server, and touching a mapped page past a file's end kills the process with SIGBUS. So the server
maps (zero copy) only memory that provably cannot shrink: a memfd sealed with F_SEAL_SHRINK (what
`edgeserve.client.FrameRing` creates; registered as ``memfd:<name>:<pid>:<fd>``). Every other region
(a POSIX object in /dev/shm, Triton's system shared memory) is never mapped: inputs are copied out
with one `pread` into server memory (a truncated file gives a short read -> INVALID_ARG naming the
region) and outputs are written with `pwrite` after checking the file's size (a write cannot fault).
Which keys a client may register at all, and whether outputs may be written there: access.py.
Which client may name a region once registered (in requests, status, unregister): binding.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterator

from edgeserve.frontends.shm.access import PEER_CREDENTIALS, TRITON, authorize
from edgeserve.frontends.shm.binding import (
    IN_PROCESS_CLIENT,
    TRITON_OWNER,
    PeerIdentity,
    ShmClient,
    principal_of,
)
from edgeserve.frontends.shm.keys import MEMFD_PREFIX, key_path, open_key, shrink_sealed
from edgeserve.frontends.shm.region import Region, RegionInfo, ShmLease
from edgeserve.protocol.errors import InferenceError, Status, invalid_arg, not_found
from edgeserve.protocol.inference import RegionNamer, ShmRef

__all__ = ["TRITON_OWNER", "RegionInfo", "SharedMemoryRegistry", "ShmClient", "ShmLease"]

log = logging.getLogger("edgeserve.shm")


class SharedMemoryRegistry:
    def __init__(
        self,
        allow_client_shm: bool = True,
        key_prefixes: list[str] | None = None,
        max_regions: int = 1024,
        registration: str = PEER_CREDENTIALS,
    ) -> None:
        self.allow_client_shm = allow_client_shm
        self.registration = registration  # [shm] registration: whose memory a client may register
        self.key_prefixes = [p.lstrip("/") for p in (key_prefixes or [])]
        self.max_regions = max_regions
        # name -> principal -> region: under "peer-credentials" each principal has its own names
        self._regions: dict[str, dict[str, Region]] = {}
        self._count = 0
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------------------
    def register(
        self,
        name: str,
        key: str,
        offset: int,
        byte_size: int,
        owner: str = "",
        peer: PeerIdentity | None = None,
    ) -> None:
        """`peer`: the client asking (None: an in-process caller, held to the rule for unknown clients);
        the region is bound to it (binding.py). `owner`: the ZeroMQ socket registering it."""
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
        if not key.startswith(MEMFD_PREFIX):
            key_path(key)  # a malformed key is INVALID_ARG before a prefix check says PERMISSION_DENIED
            if self.key_prefixes:
                self._check_prefix(key, key.lstrip("/"))
        principal = principal_of(peer)
        with self._lock:
            self._check_free(name, principal)
            if self._count >= self.max_regions:
                raise InferenceError(
                    Status.RESOURCE_EXHAUSTED, f"too many shared memory regions (max {self.max_regions})"
                )
        opened = open_key(key)
        fd = opened.fd
        mapping: mmap.mmap | None = None
        try:
            if self.key_prefixes:
                self._check_prefix(key, opened.name)
            writable = authorize(self.registration, peer, key, opened, bool(self.key_prefixes))
            size = opened.st.st_size
            if offset + byte_size > size:
                raise invalid_arg(
                    f"failed to register shared memory region '{name}': offset {offset} + byte_size "
                    f"{byte_size} is past the end of '{key}' ({size} bytes)"
                )
            if shrink_sealed(fd):  # cannot shrink: safe to map, zero copy
                access = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, access)
                os.close(fd)
                fd = -1
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        region = Region(RegionInfo(name, key, offset, byte_size), fd, mapping, owner, writable, principal)
        with self._lock:
            try:
                self._check_free(name, principal)  # lost a race with another register of the same name?
            except InferenceError:
                region.unmap()
                raise
            self._regions.setdefault(name, {})[principal] = region
            self._count += 1
        log.info(
            "shm region registered name=%s key=%s offset=%d size=%d %s%s client=%s bound_to=%s",
            name,
            key,
            offset,
            byte_size,
            "mapped (sealed)" if region.sealed else "read/written by copy",
            "" if writable else ", inputs only",
            peer.describe() if peer is not None else "in-process",
            principal,
        )

    def _check_free(self, name: str, principal: str) -> None:
        """(Under the lock.) Names are per principal; under "triton", global (as Triton's)."""
        holders = self._regions.get(name, {})
        if principal in holders or (holders and self.registration == TRITON):
            raise InferenceError(Status.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")

    def _check_prefix(self, key: str, name: str) -> None:
        if not any(name.startswith(p) for p in self.key_prefixes):
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"shared memory key '{key}' is not allowed here; allowed prefixes: {self.key_prefixes}",
            )

    # -- what a client may name -------------------------------------------------------------------
    def _find(self, name: str, principal: str, owner: str) -> Region | None:
        """(Under the lock.) The region `name` as a client (`principal`, ZeroMQ socket `owner`) may
        name it; None where it may not, exactly as where no such region exists."""
        holders = self._regions.get(name)
        if not holders:
            return None
        if self.registration == TRITON:  # name-global: any client, any region
            return holders.get(principal) or next(iter(holders.values()))
        region = holders.get(principal)
        if region is None or region.owner not in (TRITON_OWNER, owner):
            return None  # a ZeroMQ region belongs to its socket
        return region

    def _visible(self, principal: str, owner: str) -> Iterator[Region]:
        """(Under the lock.) Every region the client may name."""
        for holders in self._regions.values():
            for region in holders.values():
                if self.registration == TRITON or (
                    region.principal == principal and region.owner in (TRITON_OWNER, owner)
                ):
                    yield region

    def unregister(self, name: str = "", owner: str | None = None, client: ShmClient | None = None) -> None:
        """Unknown names (and names the client may not use) are silently fine (Triton); "" removes
        every region the client may name (of `owner`, if given). `client`: None for in-process.

        With both a name and an `owner`, only that owner's region may go: PERMISSION_DENIED otherwise."""
        client = client or ShmClient(owner=owner or TRITON_OWNER)  # in-process: as that owner
        principal = client.principal
        with self._lock:
            if name:
                found = self._find(name, principal, client.owner)
                if found is not None and owner is not None and found.owner != owner:
                    raise InferenceError(
                        Status.PERMISSION_DENIED,
                        f"shared memory region '{name}' was registered by another client; only its owner "
                        "(or the gRPC/HTTP system shared memory API) can unregister it",
                    )
                found_regions = [found] if found is not None else []
            else:
                visible = self._visible(principal, client.owner)
                found_regions = [r for r in visible if owner is None or r.owner == owner]
            to_unmap = self._take(found_regions)
        self._retired(found_regions, to_unmap)

    def drop_owner(self, owner: str) -> list[str]:
        """Unregister every region of a ZeroMQ socket that is gone, whoever it claimed to be."""
        with self._lock:
            found = [r for holders in self._regions.values() for r in holders.values() if r.owner == owner]
            to_unmap = self._take(found)
        self._retired(found, to_unmap)
        return [region.info.name for region in found]

    def _take(self, regions: list[Region]) -> list[Region]:
        """(Under the lock.) Take `regions` out; those no request holds are to be unmapped."""
        for region in regions:
            holders = self._regions[region.info.name]
            del holders[region.principal]
            if not holders:
                del self._regions[region.info.name]
            self._count -= 1
            region.retired = True
        return [r for r in regions if r.refs == 0]

    @staticmethod
    def _retired(regions: list[Region], to_unmap: list[Region]) -> None:
        for region in to_unmap:
            region.unmap()
        for region in regions:
            log.info("shm region unregistered name=%s in_flight=%d", region.info.name, region.refs)

    def status(
        self, name: str = "", owner: str | None = None, client: ShmClient | None = None
    ) -> list[RegionInfo]:
        """Regions the client may name (of `owner`, if given: the Triton-protocol APIs list only their
        own kind). `client`: None for in-process."""
        client = client or ShmClient(owner=owner or TRITON_OWNER)  # in-process: as that owner
        principal = client.principal
        with self._lock:
            if name:
                region = self._find(name, principal, client.owner)
                if region is None or (owner is not None and region.owner != owner):
                    raise not_found(f"Unable to find system shared memory region: '{name}'")
                return [region.info]
            visible = self._visible(principal, client.owner)
            return [r.info for r in visible if owner is None or r.owner == owner]

    def unregister_triton(self, name: str = "", client: ShmClient | None = None) -> None:
        """Triton-protocol unregister: its own kind of regions only; another client's ZMQ ring is left
        alone (silently, as Triton treats unknown names)."""
        if name and name not in {info.name for info in self.status(owner=TRITON_OWNER, client=client)}:
            return
        self.unregister(name, owner=TRITON_OWNER, client=client)

    def names(self, owner: str | None = None) -> list[str]:
        """Every registered name (of `owner`, if given), whoever registered it: for the server's own use."""
        with self._lock:
            return [
                r.info.name
                for holders in self._regions.values()
                for r in holders.values()
                if owner is None or r.owner == owner
            ]

    # -- use ------------------------------------------------------------------------------------
    def acquire(self, ref: ShmRef, write: bool = False, client: RegionNamer | None = None) -> ShmLease:
        """Open `ref` for one request, with every bound checked (against the registered size; a region
        that is not mapped is also checked against its file's size when read or written).
        `write`: for an output (PERMISSION_DENIED where the registering client may only read).
        `client`: who names the region (None: in-process); another client's region is NOT_FOUND."""
        client = client or IN_PROCESS_CLIENT
        principal = client.principal  # may read /proc: before the lock
        with self._lock:
            region = self._find(ref.region, principal, client.owner)
            if region is None:
                raise not_found(f"Unable to find shared memory region: '{ref.region}'")
            if write:
                region.check_writable("an output")
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
        view = None if region.map is None else memoryview(region.map)[start : start + ref.byte_size]
        return ShmLease(self._release, region, start, ref.byte_size, view)

    def _release(self, region: Region) -> None:
        with self._lock:
            region.refs -= 1
            unmap = region.retired and region.refs == 0
        if unmap:
            region.unmap()

    def close(self) -> None:
        with self._lock:
            found = [r for holders in self._regions.values() for r in holders.values()]
            to_unmap = self._take(found)
        self._retired(found, to_unmap)
