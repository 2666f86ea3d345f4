"""systemd's notify protocol without libsystemd: one datagram of KEY=VALUE lines to $NOTIFY_SOCKET.

The protocol is stable and tiny (sd_notify(3)); a leading "@" names an abstract-namespace socket.
Outside systemd (no $NOTIFY_SOCKET) every call is a no-op, so the supervisor runs the same anywhere.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("edgeserve.supervisor")

# Variables that belong to the supervisor alone: the server child must never notify (NotifyAccess=main).
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if address.startswith("@"):
            self.address = "\0" + address[1:]
        elif address.startswith("/"):
            self.address = address
        self.watchdog_interval_s = _watchdog_interval(env)
        self._socket: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one message (fields in the given order); True when it was handed to the socket."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.sendto(message, self.address)
        except OSError as exc:
            if not self._failed:  # once: a missing manager must not flood the log
                log.warning("cannot notify systemd at %s: %s", self.address.lstrip("\0"), exc)
            self._failed = True
            return False
        self._failed = False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of $WATCHDOG_USEC (sd_watchdog_enabled(3)), when the watchdog is meant for this process."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return usec / 2e6


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in NOTIFY_ENV}
