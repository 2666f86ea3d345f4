"""Opening what a shared memory key names: a POSIX object in /dev/shm, or another process's memfd.

Keys are opened with the server's rights; whether the client that named the key may have it is
decided afterwards, on the very file opened (`access.authorize`), so nothing can be swapped between
the check and the use.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat
from dataclasses import dataclass

from edgeserve.protocol.errors import InferenceError, Status, invalid_arg, not_found

SHM_DIR = "/dev/shm"
_RESERVED_PREFIX = "triton_python_backend_shm_region_"
# A sealed memfd of another process: "memfd:<name>:<pid>:<fd>", opened through /proc/<pid>/fd/<fd>.
MEMFD_PREFIX = "memfd:"
_MEMFD_KEY = re.compile(r"memfd:([A-Za-z0-9._-]{1,200}):([1-9][0-9]{0,9}):([0-9]{1,9})")
_PAGE = mmap.PAGESIZE
_NO_ACL = (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP)


@dataclass(frozen=True, slots=True)
class Opened:
    """A key opened O_RDWR: the file, the name key prefixes apply to, and who may reach it."""

    fd: int
    name: str
    st: os.stat_result
    memfd_holder: int | None  # a memfd: the uid of the process whose descriptor the key names
    acl: bool  # a POSIX ACL: the mode bits alone do not say who may open it


def key_path(key: str) -> str:
    stripped = key.lstrip("/")
    if not stripped:
        raise invalid_arg(f"shared memory key '{key}' is empty or only slashes")
    if "/" in stripped or stripped in (".", ".."):
        raise invalid_arg(f"shared memory key '{key}' must name one object in {SHM_DIR}")
    if stripped.startswith(_RESERVED_PREFIX):
        raise invalid_arg(f"shared memory key '{key}' uses a reserved prefix")
    return os.path.join(SHM_DIR, stripped)


def _open_error(key: str, exc: OSError) -> InferenceError:
    message = f"Unable to open shared memory region: '{key}' ({exc.strerror})"
    if exc.errno in (errno.ENOENT, errno.ESRCH):
        return not_found(message)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InferenceError(Status.PERMISSION_DENIED, message)
    return invalid_arg(message)


def shrink_sealed(fd: int) -> bool:
    """True for a memfd/shmem file sealed against shrinking, in small pages (a hugetlb memfd can
    still fault with SIGBUS when the huge page pool runs dry)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a shmem file
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK) and os.fstat(fd).st_blksize == _PAGE


def _has_acl(fd: int) -> bool:
    try:
        os.getxattr(fd, "system.posix_acl_access")
    except OSError as exc:
        return exc.errno not in _NO_ACL  # unreadable: assume one (the safe side)
    return True


def open_key(key: str) -> Opened:
    """Open the regular file `key` names, read-write, with the server's rights."""
    if "\0" in key:
        raise invalid_arg("shared memory key must not contain a NUL byte")
    match = _MEMFD_KEY.fullmatch(key)
    if match is None:
        if key.startswith(MEMFD_PREFIX):
            raise invalid_arg(
                f"shared memory key '{key}' must be 'memfd:<name>:<pid>:<fd>' (name: letters, digits, . _ -)"
            )
        path = key_path(key)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise _open_error(key, exc) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise invalid_arg(f"shared memory key '{key}' is not a shared memory object")
        return Opened(fd, key.lstrip("/"), info, None, _has_acl(fd))
    name, pid, number = match.group(1), int(match.group(2)), int(match.group(3))
    fd, holder = _open_memfd(key, name, pid, number)
    if not shrink_sealed(fd):
        os.close(fd)
        raise invalid_arg(f"shared memory key '{key}': a memfd must be sealed with F_SEAL_SHRINK")
    return Opened(fd, name, os.fstat(fd), holder, False)


def _open_memfd(key: str, name: str, pid: int, number: int) -> tuple[int, int]:
    """(an O_RDWR fd of the memfd, the uid of the process holding it). The /proc/<pid> directory is
    held open while the descriptor is reached through it, so a pid reused meanwhile changes nothing."""
    try:
        proc = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _open_error(key, exc) from None
    try:
        holder = os.fstat(proc).st_uid
        # O_PATH opens nothing (no device or FIFO side effects); the checks below are on that very file.
        path_fd = os.open(f"fd/{number}", os.O_PATH | os.O_CLOEXEC, dir_fd=proc)
    except OSError as exc:
        raise _open_error(key, exc) from None
    finally:
        os.close(proc)
    try:
        info = os.fstat(path_fd)
        target = os.readlink(f"/proc/self/fd/{path_fd}")
        if not stat.S_ISREG(info.st_mode) or target != f"/memfd:{name} (deleted)":
            raise invalid_arg(f"shared memory key '{key}' does not name a memfd called '{name}'")
        try:
            return os.open(f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC), holder
        except OSError as exc:
            raise _open_error(key, exc) from None
    finally:
        os.close(path_fd)
