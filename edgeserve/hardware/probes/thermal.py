"""Thermal zones (/sys/class/thermal/thermal_zone*): name and temperature, for the summary and telemetry."""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot


@dataclass(frozen=True)
class ThermalZone:
    zone: str  # thermal_zone0
    kind: str  # the zone's `type`, e.g. cpu-thermal, GPU-therm, x86_pkg_temp
    temp_c: float | None  # None when unreadable


def probe_thermal(root: FsRoot) -> tuple[ThermalZone, ...]:
    zones: list[ThermalZone] = []
    names = [n for n in root.listdir("sys/class/thermal") if re.fullmatch(r"thermal_zone\d+", n)]
    for name in sorted(names, key=lambda n: int(n[len("thermal_zone") :])):
        milli = root.read_int(f"sys/class/thermal/{name}/temp")
        temp = None if milli is None or not -50_000 <= milli <= 200_000 else milli / 1000.0
        zones.append(ThermalZone(name, root.read_line(f"sys/class/thermal/{name}/type") or "unknown", temp))
    return tuple(zones)
