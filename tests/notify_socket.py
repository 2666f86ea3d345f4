"""systemd's side of the notify protocol: a datagram socket standing in for $NOTIFY_SOCKET that records
every datagram with its arrival time (tests/supervisor, benchmarks/bench_appliance.py)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import NamedTuple


class Message(NamedTuple):
    at: float  # monotonic arrival time
    fields: dict[str, str]


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET (a path, or "@name" abstract)."""

    def __init__(self, path: Path | None = None, abstract: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract is not None:
            self.sock.bind("\0" + abstract)
            self.address = "@" + abstract
        else:
            assert path is not None
            self.sock.bind(str(path))
            self.address = str(path)
        self.sock.settimeout(0.2)
        self.messages: list[Message] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._lock:
                self.messages.append(Message(time.monotonic(), fields))

    def snapshot(self) -> list[Message]:
        with self._lock:
            return list(self.messages)

    def with_key(self, key: str, since: float = 0.0) -> list[Message]:
        return [m for m in self.snapshot() if key in m.fields and m.at >= since]

    def wait_for(
        self, key: str, value: str | None = None, timeout: float = 60.0, since: float = 0.0
    ) -> Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.with_key(key, since):
                if value is None or message.fields[key] == value:
                    return message
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value or '*'} within {timeout}s; got {self.snapshot()}")

    def statuses(self, since: float = 0.0) -> list[str]:
        return [m.fields["STATUS"] for m in self.with_key("STATUS", since)]

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)
