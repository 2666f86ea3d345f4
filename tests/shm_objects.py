"""Real /dev/shm objects of a chosen owner, group and mode, for the tests of whose memory a client may
register (tests/frontends/shm/test_shm_access.py, tests/security/test_shm_registration.py)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def shm_object(
    owner: int, group: int, mode: int, data: bytes = b"payload!", *, prefix: str = "es_acc", size: int = 8192
) -> Iterator[str]:
    """The key of a fresh object holding `data` (zero-padded to `size`), removed afterwards."""
    key = f"{prefix}_{uuid.uuid4().hex[:10]}"
    path = Path("/dev/shm") / key
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
        os.fchown(fd, owner, group)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    try:
        yield key
    finally:
        path.unlink(missing_ok=True)
