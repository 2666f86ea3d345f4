"""What the fleet commands print: devices publish most of it (ids from topic levels, health, versions,
answers, errors), so every device-supplied string goes through `text` (edgeserve.logs.safe: control
characters, ANSI/OSC escapes and bidi overrides shown escaped, long text cut). No broker publisher writes
on the operator's terminal: no window title, clipboard write or fake row. (`--json` output is JSON with
non-ASCII escaped: json.dumps' default.)"""

from __future__ import annotations

import json
from typing import Any

from edgeserve.fleet.protocol import SUCCEEDED
from edgeserve.logs import safe


def text(value: Any, limit: int = 200) -> str:
    """A device-supplied value as text a terminal shows as it is (nothing in it is a control sequence)."""
    return safe(value, limit)


def ids(devices: list[str]) -> str:
    return ",".join(text(device, 80) for device in devices)


def version(number: Any) -> str:
    return f"v{number}" if number is not None else "-"


def describe(update: dict[str, Any]) -> str:
    parts = [text(update.get("status"), 40)]
    progress = update.get("progress")
    if isinstance(progress, (int, float)) and not isinstance(progress, bool):
        parts.append(f"{float(progress) * 100:.0f}%")
    for key in ("message", "error"):
        if update.get(key):
            parts.append(text(update[key], 400))
    if update.get("result") is not None:  # JSON with non-ASCII escaped: nothing raw reaches the terminal
        parts.append("result " + text(json.dumps(update["result"], default=str), 2000))
    return " ".join(parts)


def progress_line(event: dict[str, Any]) -> str | None:
    kind = event["event"]
    if kind == "start":
        skipped = (
            f", {len(event['skipped'])} offline skipped: {ids(event['skipped'])}" if event["skipped"] else ""
        )
        waves = event["waves"]
        return (
            f"rollout of {text(event['url'])}: {event['selected']} devices selected{skipped}; waves {waves}"
        )
    if kind == "pause":
        return f"pause {event['seconds']:g} s before wave {event['next_wave']}"
    if kind == "wave_start":
        wave = event["devices"]
        return f"wave {event['wave']} ({event['kind']}, {len(wave)} devices): {ids(wave)}"
    if kind == "device":
        if event["status"] == "ACCEPTED":
            return None  # one line per device for the start is noise; progress and the outcome count
        return f"  {text(event['device'], 80)}: {describe(event)}"
    if kind == "wave_done":
        failed = f" failed: {ids(event['failed'])}" if event["failed"] else ""
        return (
            f"wave {event['wave']} done in {event['duration_s']:.1f} s: {event['succeeded']}/{event['size']} "
            f"succeeded{failed}; failure ratio so far {event['failed_total']}/{event['tried']}"
        )
    if kind == "stop":
        return f"STOP: {text(event['reason'], 400)}"
    if kind == "rollback_start":
        cannot = f"; cannot: {text(event['cannot'], 2000)}" if event["cannot"] else ""
        back = event["devices"]
        return f"rolling back {len(back)} devices of the stopped wave: {ids(back)}{cannot}"
    if kind == "rollback_device":
        return (
            None
            if event["status"] == "ACCEPTED"
            else f"  rollback {text(event['device'], 80)}: {describe(event)}"
        )
    if kind == "rollback_done":
        ok = sum(1 for r in event["devices"].values() if r["status"] == SUCCEEDED)
        return f"rollback done in {event['duration_s']:.1f} s: {ok}/{len(event['devices'])} rolled back"
    if kind == "done":
        c = event["counts"]
        verdict = "STOPPED" if event["stopped"] else ("OK" if event["ok"] else "INCOMPLETE")
        return (
            f"{verdict} in {event['duration_s']:.1f} s: {c['succeeded']} succeeded, {c['failed']} failed, "
            f"{c['not_attempted']} not attempted, {c['skipped_offline']} offline skipped, "
            f"{c['rolled_back']} rolled back (of {c['selected']} selected)"
        )
    return None
