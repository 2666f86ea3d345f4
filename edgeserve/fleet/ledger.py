"""The command ledger: every command the device accepted, with its outcome, so that none runs twice.

An accepted command is remembered until it can no longer arrive valid: its signed `expires_at` (plus the
clock skew the device tolerates), which `[fleet] max_command_lifetime_s` bounds. Nothing that arrives
meanwhile pushes it out: only verified commands are accepted, each for a bounded time, so the ledger
stays bounded by the fleet's own command rate; past `MAX_ACCEPTED` live entries a new command is refused
(LedgerFull, answered REJECTED) rather than a live one forgotten, which would let it be replayed.
Refusals (an unsigned job, a duplicate) never enter the accepted entries: they are kept, if at all, in a
small in-memory structure of their own, where forgetting one costs only a second refusal.

On disk (`fleet/commands.json`, fsync'd on change): {key: entry}, entry holding "until" (epoch seconds),
"at", "status" and what the agent keeps to answer a duplicate. RUNNING entries are kept until their final
outcome is recorded (at most the running and queued commands)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeserve.fsutil import write_json_atomic

FAILED = "FAILED"  # as protocol.FAILED (the ledger stays free of protocol imports)
RUNNING = "RUNNING"  # a ledger mark: accepted, no final status yet
CLOCK_SKEW_S = 300.0  # as signed.CLOCK_SKEW_S: a clock corrected by this much does not bring one back
MAX_ACCEPTED = 4096  # live entries; a command past this is refused, never a live entry forgotten
KEEP_REFUSALS = 256  # refused job executions remembered (in memory) to answer a re-offer the same way
INTERRUPTED = "interrupted: the device restarted while it ran; what was under way was undone"


class LedgerFull(Exception):
    """No room for another accepted command without forgetting one that is still valid."""


def hex_or_none(data: bytes | None) -> str | None:
    """MQTT 5 CorrelationData as the ledger keeps it (JSON has no bytes)."""
    return data.hex() if data is not None else None


def unhex_or_none(text: Any) -> bytes | None:
    try:
        return bytes.fromhex(text) if isinstance(text, str) else None
    except ValueError:
        return None


class CommandLedger:
    def __init__(
        self,
        path: Path,
        max_lifetime_s: float,
        *,
        max_accepted: int = MAX_ACCEPTED,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_lifetime_s = max_lifetime_s
        self.max_accepted = max_accepted
        self._clock = clock  # the wall clock: expires_at is a wall-clock time
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._refused: OrderedDict[str, dict[str, Any]] = OrderedDict()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            data = {}
        for key, entry in data.items() if isinstance(data, dict) else ():
            if isinstance(entry, dict):
                if not isinstance(entry.get("until"), (int, float)):  # an older release's entry
                    at = entry.get("at")
                    entry["until"] = (at if isinstance(at, (int, float)) else self._clock()) + self._longest()
                self._entries[str(key)] = entry

    def _longest(self) -> float:
        """How long after its acceptance a command can still arrive valid, at the most."""
        return self.max_lifetime_s + 2 * CLOCK_SKEW_S

    def get(self, key: str) -> dict[str, Any] | None:
        """The accepted entry of `key`, else the refusal remembered for it, else None."""
        with self._lock:
            entry = self._entries.get(key) or self._refused.get(key)
            return dict(entry) if entry is not None else None

    def accept(self, entries: dict[str, dict[str, Any]], expires_at: float) -> None:
        """Remember an accepted command (under one key or several: a job and its command) until
        `expires_at` (epoch seconds) has passed; LedgerFull, and none of them kept, when there is no room
        for them all below the cap (nothing is forgotten to make room)."""
        now = self._clock()
        until = min(expires_at + CLOCK_SKEW_S, now + self._longest())
        with self._lock:
            self._prune(now)
            new = sum(1 for key in entries if key not in self._entries)
            if len(self._entries) + new > self.max_accepted:
                ends = [float(e["until"]) for e in self._entries.values() if e.get("status") != RUNNING]
                first = min(ends, default=now)
                raise LedgerFull(
                    f"busy: this device holds {len(self._entries)} accepted commands that are still within "
                    f"their lifetime (the most it remembers); one can be taken again in "
                    f"{max(first - now, 0):.0f} s"
                )
            for key, entry in entries.items():
                self._entries[key] = {**entry, "at": now, "until": until}
            write_json_atomic(self.path, self._entries)

    def record(self, key: str, entry: dict[str, Any]) -> None:
        """The outcome of an accepted command (its `until` is kept); a key never accepted is not added."""
        with self._lock:
            old = self._entries.get(key)
            if old is None:
                return
            self._entries[key] = {**entry, "at": self._clock(), "until": old["until"]}
            write_json_atomic(self.path, self._entries)

    def refuse(self, key: str, entry: dict[str, Any]) -> None:
        """A refusal (in memory, bounded, oldest forgotten first): a re-offer is refused again anyway."""
        with self._lock:
            self._refused[key] = dict(entry)
            self._refused.move_to_end(key)
            while len(self._refused) > KEEP_REFUSALS:
                self._refused.popitem(last=False)

    def _prune(self, now: float) -> None:
        expired = [k for k, e in self._entries.items() if e.get("status") != RUNNING and e["until"] < now]
        for key in expired:
            del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def interrupted(self) -> list[tuple[str, dict[str, Any]]]:
        """Commands accepted by an earlier run that never finished (the agent was killed)."""
        with self._lock:
            return [(k, dict(v)) for k, v in self._entries.items() if v.get("status") == RUNNING]

    def fail_interrupted(self) -> list[tuple[str, bytes | None, dict[str, Any]]]:
        """Record every interrupted command as FAILED; (reply topic or "", correlation, answer) of each."""
        answers = []
        for cmd_id, entry in self.interrupted():
            self.record(cmd_id, {"verb": entry.get("verb"), "status": FAILED, "error": INTERRUPTED})
            answer = {"cmd_id": cmd_id, "status": FAILED, "error": INTERRUPTED}
            answers.append((str(entry.get("reply") or ""), unhex_or_none(entry.get("correlation")), answer))
        return answers
