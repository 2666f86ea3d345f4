"""Request size limits sized for the box, the same on every frontend.

`[http] max_input_bytes`, `[grpc] max_message_bytes` and `[zmq] max_message_bytes` default to 0:
"from the device's memory budget" (the hardware probe's cgroup-aware figure): 1/32 of it, between
32 MiB and 256 MiB (a 4 GB box: 128 MiB; an 8 GB box and up: 256 MiB; unknown: 64 MiB). A 4K
camera frame fits (uint8 25 MB, FP32 100 MB); a few oversized requests cannot exhaust the box.
A value set in the settings is used as it is.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeserve.config import Settings

log = logging.getLogger("edgeserve.limits")

MIN_REQUEST_BYTES = 32 * 2**20
MAX_REQUEST_BYTES = 256 * 2**20
UNKNOWN_BUDGET_REQUEST_BYTES = 64 * 2**20
BUDGET_FRACTION = 32


def limit_for_budget(memory_bytes: int | None) -> int:
    if not memory_bytes:
        return UNKNOWN_BUDGET_REQUEST_BYTES
    return max(MIN_REQUEST_BYTES, min(MAX_REQUEST_BYTES, memory_bytes // BUDGET_FRACTION))


@functools.lru_cache(maxsize=8)
def _probed_budget(root: str) -> int | None:
    from edgeserve.hardware.probes import FsRoot
    from edgeserve.hardware.probes.memory import probe_cgroup, probe_memory, resource_budget

    try:
        fs = FsRoot(root)
        return resource_budget(1, probe_memory(fs), probe_cgroup(fs)).memory_bytes
    except Exception as exc:  # a probe failure must not stop the server: the fixed default applies
        log.warning(
            "memory budget unknown (%s); request size limit %d MiB", exc, UNKNOWN_BUDGET_REQUEST_BYTES >> 20
        )
        return None


def device_request_limit(settings: Settings) -> int:
    """The default request size limit for this box (hardware_root of the settings)."""
    return limit_for_budget(_probed_budget(str(Path(settings.runtime.hardware_root))))


def request_limit(configured: int, settings: Settings) -> int:
    """`configured` when set (> 0), else the device default."""
    return configured if configured > 0 else device_request_limit(settings)


def too_large_message(size: int, limit: int, setting: str) -> str:
    return (
        f"request of {size} bytes exceeds the limit of {limit} bytes ({setting}); send less per "
        "request, use shared memory for large tensors, or raise the setting"
    )
