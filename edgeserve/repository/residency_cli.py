"""`edgeserve models list`: the repository index, with each model's memory, instances and evictions
read from the server's `/metrics` (best effort: an older server without them shows '-')."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from typing import Any

_SAMPLE = re.compile(r'^(edgeserve_[a-z_]+)(?:\{model="([^"]*)"\})? (\S+)$')
MIB = 2**20


def residency_metrics(base: str) -> dict[str, dict[str, float]]:
    """metric name -> model ("" for server-wide) -> value; {} when /metrics does not answer."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            try:
                found.setdefault(match.group(1), {})[match.group(2) or ""] = float(match.group(3))
            except ValueError:
                continue
    return found


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f} MiB"


def print_index(index: list[dict[str, Any]], base: str) -> None:
    figures = residency_metrics(base)
    memory = figures.get("edgeserve_model_memory_bytes", {})
    instances = figures.get("edgeserve_model_instances", {})
    evictions = figures.get("edgeserve_evictions_total", {})
    print(f"{'MODEL':24} {'VERSION':8} {'STATE':12} {'MEMORY':>10} {'INST':>4} {'EVICT':>5} REASON")
    for entry in index:
        name = str(entry["name"])
        ready = entry.get("state") == "READY"
        count = instances.get(name)
        print(
            f"{name:24} {entry.get('version', ''):8} {entry.get('state', ''):12} "
            f"{_mib(memory.get(name)) if ready else '-':>10} "
            f"{'-' if count is None or not ready else int(count):>4} "
            f"{int(evictions.get(name, 0)):>5} {entry.get('reason', '')}"
        )
    budget = figures.get("edgeserve_memory_budget_bytes", {}).get("")
    used = figures.get("edgeserve_memory_used_bytes", {}).get("")
    if budget:
        print(f"memory: {_mib(used)} of the {_mib(budget)} budget held by models")
