"""Loopback ports for test servers, taken outside the kernel's ephemeral range.

A port from `bind(0)` comes from the ephemeral range, and once it is closed any outgoing connection on
the box may take it as its local port before the server under test binds it: the appliance's own MQTT
connection did, and its server then failed to bind for as long as that connection lived. Ports below
(or above) that range are never handed to outgoing connections. Each xdist worker draws from its own
slice, walking it from a random start. Suites run side by side (other checkouts on the same box) have
workers of the same names, so a port handed out is also reserved machine-wide: an exclusive flock on
`<tmp>/edgeserve-test-ports/<port>`, held by this process for its last RESERVED_MAX ports, which another
test process skips. Without it, three suites side by side handed one port to two servers: one failed
to bind, or a test's HTTP client read the other suite's gRPC server ("BadStatusLine").
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import random
import socket
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

SLICES = 16
LOWEST = 10000
# A reservation covers the time from the hand-out to the server's bind, and a server restarted on its
# port; 128 held locks are the last few dozen servers of this process, and 128 fds at most.
RESERVED_MAX = 128
LOCKS = Path(tempfile.gettempdir()) / "edgeserve-test-ports"


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
_reserved: OrderedDict[int, int] = OrderedDict()  # port -> the fd holding its flock


def _reserve(port: int) -> bool:
    """Take `port` machine-wide (lock held); False when another test process, or this one, holds it.
    No lock folder to write (a read-only /tmp): True, the bind check alone decides, as before."""
    try:
        if not LOCKS.is_dir():
            LOCKS.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                LOCKS.chmod(0o1777)  # other users' suites reserve here too
        fd = os.open(LOCKS / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _reserved[port] = fd
    while len(_reserved) > RESERVED_MAX:
        os.close(_reserved.popitem(last=False)[1])
    return True


def free_port() -> int:
    """A loopback TCP port that nothing holds now, no outgoing connection will take and no other test
    process on this box was handed recently."""
    with _lock:
        for _ in range(2000):
            port = next(_walk)
            if port in _reserved:  # handed out by this process not long ago: its server may hold it
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                port = int(sock.getsockname()[1])
            if port == 0 or _reserve(port):
                return port
    raise RuntimeError("no free loopback port outside the ephemeral range")
