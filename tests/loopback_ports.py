"""Loopback ports for test servers, taken outside the kernel's ephemeral range.

A port from `bind(0)` comes from the ephemeral range, and once it is closed any outgoing connection on
the box may take it as its local port before the server under test binds it: the appliance's own MQTT
connection did, and its server then failed to bind for as long as that connection lived. Ports below
(or above) that range are never handed to outgoing connections. Each xdist worker draws from its own
slice, walking it from a random start, so workers and runs side by side do not pick the same port.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

SLICES = 16
LOWEST = 10000


def _window() -> tuple[int, int]:
    """Ports no outgoing connection takes; empty when the ephemeral range leaves too few."""
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - LOWEST >= 4000:
        return LOWEST, low
    if 65536 - (high + 1) >= 4000:
        return high + 1, 65536
    return 0, 0


def _slice_walk() -> Iterator[int]:
    start, end = _window()
    width = (end - start) // SLICES
    if width == 0:  # an ephemeral range that covers nearly every port: the kernel picks (bind 0)
        return itertools.repeat(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = start + (int(worker) % SLICES if worker.isdigit() else 0) * width
    offset = random.randrange(width)
    return (first + (offset + step) % width for step in itertools.count())


_walk = _slice_walk()
_lock = threading.Lock()


def free_port() -> int:
    """A loopback TCP port that nothing holds now and no outgoing connection will take."""
    with _lock:
        for _ in range(2000):
            port = next(_walk)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return int(sock.getsockname()[1])
    raise RuntimeError("no free loopback port outside the ephemeral range")
