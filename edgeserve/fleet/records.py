"""The fleet manager's pure logic, no MQTT: the broker address, the device record merged from a device's
retained topics, device selectors, the wave plan of a staged rollout, and a command in flight."""

from __future__ import annotations

import fnmatch
import math
import queue
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from edgeserve.fleet.protocol import check_segment
from edgeserve.logs import safe

Json = dict[str, Any]
TIMEOUT = "TIMEOUT"  # synthetic status: no final answer in time (never sent by a device)


class FleetError(RuntimeError):
    """The broker cannot be reached or refused us, or a request to the manager is wrong."""


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        parts = urlsplit(url if "://" in url else f"mqtt://{url}")
        if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise FleetError(f"broker URL {url!r}: the scheme must be mqtt:// or mqtts://")
        tls = parts.scheme in ("mqtts", "ssl")
        if not parts.hostname:
            raise FleetError(f"broker URL {url!r} has no host")
        try:
            port = parts.port or (8883 if tls else 1883)
        except ValueError:
            raise FleetError(f"broker URL {url!r} has a bad port") from None
        return cls(unquote(parts.hostname), port, tls)


def segment(value: str, what: str) -> str:
    try:
        return check_segment(value, what)
    except ValueError as exc:
        raise FleetError(str(exc)) from None


def _as_version(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def device_record(device: str, topics: dict[str, Json]) -> Json:
    """One device's retained topics merged into a flat record (missing topics give None fields)."""
    state, info = topics.get("state", {}), topics.get("info", {})
    health, reported = topics.get("health", {}), topics.get("reported", {})
    bundle: Json = info["bundle"] if isinstance(info.get("bundle"), dict) else {}
    active = _as_version(reported.get("active_version"))
    previous = _as_version(reported.get("previous_version"))
    return {
        "device": device,
        "online": state.get("online") is True,
        "version": state.get("version", info.get("edgeserve")),
        "boot_id": state.get("boot_id"),
        "since": state.get("at"),
        "active_version": active if active is not None else _as_version(bundle.get("active_version")),
        "previous_version": previous if previous is not None else _as_version(bundle.get("previous_version")),
        "bundle_name": bundle.get("name"),
        "generation": reported.get("generation"),
        "phase": reported.get("phase"),
        "health": health.get("status"),
        "health_checks": health.get("checks", []),
        "hardware": info.get("hardware"),
        "backends": info.get("backends"),
        "models": reported.get("models"),
        "seen": sorted(topics),
    }


def select_devices(records: Iterable[Json], selector: str) -> list[str]:
    """Device ids for a selector: "all", "online", or a comma list of ids and globs ("cam-*,door-2").

    An id without glob characters must be a known device (FleetError otherwise); a glob that matches
    nothing is an error as well, so that a typo cannot turn into an empty rollout.
    """
    records = list(records)
    known = {r["device"]: r for r in records}
    selector = selector.strip()
    if selector in ("", "all"):
        return sorted(known)
    if selector == "online":
        return sorted(d for d, r in known.items() if r["online"])
    chosen: set[str] = set()
    for item in (part.strip() for part in selector.split(",")):
        if not item:
            continue
        if any(ch in item for ch in "*?["):
            matched = fnmatch.filter(known, item)
            if not matched:
                raise FleetError(f"selector {item!r} matches no device of the fleet")
            chosen.update(matched)
        elif item in known:
            chosen.add(item)
        else:
            raise FleetError(f"device {item!r} is not known to the fleet (no retained state/info)")
    return sorted(chosen)


def plan_waves(devices: list[str], canary_percent: float, wave_size: int) -> list[list[str]]:
    """The canary wave (ceil(canary% of N), at least 1; none when the percent is 0), then wave_size waves."""
    if wave_size < 1:
        raise FleetError("wave size must be at least 1")
    if not 0 <= canary_percent <= 100:
        raise FleetError("canary percent must be between 0 and 100")
    waves: list[list[str]] = []
    rest = list(devices)
    if canary_percent > 0 and rest:
        count = max(1, math.ceil(canary_percent / 100 * len(rest) - 1e-9))
        waves.append(rest[:count])
        rest = rest[count:]
    waves.extend(rest[i : i + wave_size] for i in range(0, len(rest), wave_size))
    return waves


@dataclass
class Pending:
    """A command in flight: its answers arrive in `sink` as (cmd_id, body)."""

    cmd_id: str
    device: str
    verb: str
    sink: queue.Queue[tuple[str, Json]]
    unsubscribe: str | None = None
    updates: list[Json] = field(default_factory=list)


def timed_out(pending: Pending, timeout_s: float) -> Json:
    """The synthetic final answer of a command that got none within `timeout_s`."""
    last = pending.updates[-1] if pending.updates else None
    return {
        "cmd_id": pending.cmd_id,
        "status": TIMEOUT,
        "error": f"no final answer from {pending.device} within {timeout_s:g} s"
        + (f" (last: {safe(last.get('status'), 40)})" if last else " (no answer at all)"),
        "last": last,
    }
