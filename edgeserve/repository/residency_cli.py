"""`edgeserve models list`: the repository index, with each model's memory, instances and evictions
read from the server's `/metrics`, and each ready model's runtime plan (what serves, on what evidence,
final or still racing in the background) read from its served config (best effort: an older server
without them shows '-' and no plan)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
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


PLAN_CHARS = 240  # the plan's evidence can list every candidate: one line of it is enough here


def plan_of(base: str, name: str) -> str | None:
    """The runtime plan line of a ready model, from `/v2/models/{name}/config`'s parameters."""
    url = f"{base}/v2/models/{urllib.parse.quote(name, safe='')}/config"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            parameters = json.loads(response.read()).get("parameters") or {}
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None

    def text(key: str) -> str:
        value = parameters.get(key)
        return str(value.get("string_value", "")) if isinstance(value, dict) else ""

    choice = text("runtime_choice")
    if not choice:
        return None
    state = {"true": "final", "false": "provisional, racing on in the background"}.get(
        text("runtime_choice_final"), "rule"
    )
    line = f"plan ({state}): {choice}"
    if text("batch_size_choice"):
        line += f"; batch: {text('batch_size_choice')}"
    return line if len(line) <= PLAN_CHARS else line[: PLAN_CHARS - 3] + "..."


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
        plan = plan_of(base, name) if ready else None
        if plan:
            print(f"  {plan}")
    budget = figures.get("edgeserve_memory_budget_bytes", {}).get("")
    used = figures.get("edgeserve_memory_used_bytes", {}).get("")
    if budget:
        print(f"memory: {_mib(used)} of the {_mib(budget)} budget held by models")
