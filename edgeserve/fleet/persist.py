"""What the agent must not forget across restarts besides its command ledger (ledger.py): the desired
generation applied last, and the events it could not send yet (so none is lost while the broker is away)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from edgeserve.fsutil import PRIVATE_FILE, private_mkdir, write_json_atomic


class Generation:
    """The `desired` generation applied last, and how it ended (a generation is applied once)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, generation: int, outcome: str) -> None:
        write_json_atomic(self.path, {"generation": generation, "outcome": outcome, "at": time.time()})


class Outbox:
    """Events in order, on disk until the broker acknowledged them (QoS 1 PUBACK).

    `events.jsonl` is append-only (one fsync'd line per event); `events.acked` holds the last sequence
    number the broker took. Bounded: past `keep` unsent events the oldest are dropped and counted."""

    def __init__(self, folder: Path, keep: int = 10_000) -> None:
        private_mkdir(folder)  # owner-only whatever the umask (UMask=0007 is for the ZeroMQ socket)
        self.log_path = folder / "events.jsonl"
        self.acked_path = folder / "events.acked"
        self.keep = keep
        self.dropped = 0
        self._lock = threading.Lock()
        self._pending: deque[dict[str, Any]] = deque()
        try:
            acked = int(self.acked_path.read_text().strip() or 0)
        except (OSError, ValueError):
            acked = 0
        self._seq = acked
        try:
            for line in self.log_path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut by a power loss: the events after it are whole
                    continue
                self._seq = max(self._seq, int(entry.get("seq", 0)))
                if int(entry.get("seq", 0)) > acked:
                    self._pending.append(entry)
        except OSError:
            pass

    def add(self, topic: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._seq += 1
            entry = {"seq": self._seq, "topic": topic, "payload": payload}
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
            with os.fdopen(fd, "a") as fh:
                fh.write(json.dumps(entry) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            self._pending.append(entry)
            while len(self._pending) > self.keep:
                self._pending.popleft()
                self.dropped += 1

    def peek(self) -> dict[str, Any] | None:
        with self._lock:
            return dict(self._pending[0]) if self._pending else None

    def ack(self, seq: int) -> None:
        with self._lock:
            while self._pending and int(self._pending[0]["seq"]) <= seq:
                self._pending.popleft()
            tmp = self.acked_path.with_suffix(".tmp")
            tmp.write_text(str(seq))
            os.replace(tmp, self.acked_path)
            if not self._pending and self.log_path.exists() and self.log_path.stat().st_size > 1 << 20:
                self.log_path.unlink()  # all sent: start a fresh log instead of growing this one

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
