"""Memory and the CPU/memory budget, with cgroup v1 and v2 limits honoured.

`os.cpu_count()` and /proc/meminfo describe the host; inside a container or a systemd slice the
process gets less. Effective CPUs = min(online, cpuset, ceil(quota / period)); memory = min(MemTotal,
memory.max / memory.limit_in_bytes) along the cgroup's ancestry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot, key_values, parse_cpu_list

_UNLIMITED_BYTES = 1 << 60  # v1 writes 9223372036854771712 (page-rounded INT64_MAX) for "no limit"


@dataclass(frozen=True)
class CgroupLimits:
    version: int  # 0 = no cgroup filesystem found, 1, 2
    path: str  # the process's own cgroup path ("/" in a namespaced container)
    cpu_quota: float | None  # CPUs allowed by quota/period; None = unlimited
    cpuset: tuple[int, ...] | None  # CPUs allowed by cpuset; None = all
    memory_limit: int | None  # bytes; None = unlimited
    sources: tuple[str, ...]  # the files that set a limit, for the "why"


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int | None  # MemTotal
    available_bytes: int | None  # MemAvailable


@dataclass(frozen=True)
class ResourceBudget:
    """What this process may use: the numbers thread counts and memory headroom derive from."""

    host_cpus: int
    effective_cpus: int
    cpu_reason: str
    memory_bytes: int | None
    memory_reason: str


def probe_memory(root: FsRoot) -> MemoryInfo:
    values = key_values(root.read_text("proc/meminfo"))

    def kib(key: str) -> int | None:
        raw = values.get(key, "").split()
        if not raw:
            return None
        try:
            amount = int(raw[0])
        except ValueError:
            return None
        return amount * 1024 if len(raw) < 2 or raw[1].lower() == "kb" else amount

    return MemoryInfo(total_bytes=kib("MemTotal"), available_bytes=kib("MemAvailable"))


def _own_paths(root: FsRoot) -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) from /proc/self/cgroup."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in (root.read_text("proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path or "/"
        else:
            for controller in controllers.split(","):
                if controller:
                    v1[controller] = path or "/"
    return v2, v1


def _ancestry(base: str, path: str) -> list[str]:
    """Directories from the process's cgroup up to the mount root (limits of ancestors apply too)."""
    parts = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    dirs = [base + "/" + "/".join(parts[:i]) if i else base for i in range(len(parts), -1, -1)]
    return [d.rstrip("/") for d in dirs]


def _existing_dirs(root: FsRoot, base: str, path: str) -> list[str]:
    """The ancestry that exists; in a namespaced container the host path does not: the mount root counts."""
    return [d for d in _ancestry(base, path) if root.is_dir(d)] or ([base] if root.is_dir(base) else [])


def _min_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def probe_cgroup(root: FsRoot) -> CgroupLimits:
    v2_path, v1_paths = _own_paths(root)
    sources: list[str] = []
    quota: float | None = None
    memory: float | None = None
    cpuset: tuple[int, ...] | None = None

    if root.exists("sys/fs/cgroup/cgroup.controllers"):
        path = v2_path or "/"
        for d in _existing_dirs(root, "sys/fs/cgroup", path):
            fields = (root.read_line(f"{d}/cpu.max") or "").split()
            if fields and fields[0] != "max":
                try:
                    q, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
                    if q > 0 and period > 0:
                        quota = _min_opt(quota, q / period)
                        sources.append(f"/{d}/cpu.max = {q} {period}")
                except ValueError:
                    pass
            for name in ("memory.max", "memory.high"):
                raw = root.read_line(f"{d}/{name}")
                if raw and raw != "max" and raw.isdigit() and int(raw) < _UNLIMITED_BYTES:
                    memory = _min_opt(memory, int(raw))
                    sources.append(f"/{d}/{name} = {raw}")
            if cpuset is None:
                cpus = parse_cpu_list(root.read_line(f"{d}/cpuset.cpus.effective"))
                if cpus is not None:
                    cpuset = cpus
        return CgroupLimits(2, path, quota, cpuset, None if memory is None else int(memory), tuple(sources))

    found_v1 = False
    for controller, mounts in (
        ("cpu", ("cpu", "cpu,cpuacct", "cpuacct,cpu")),
        ("memory", ("memory",)),
        ("cpuset", ("cpuset",)),
    ):
        mount = next((f"sys/fs/cgroup/{m}" for m in mounts if root.is_dir(f"sys/fs/cgroup/{m}")), None)
        if mount is None:
            continue
        found_v1 = True
        for d in _existing_dirs(root, mount, v1_paths.get(controller, "/")):
            if controller == "cpu":
                q1, p1 = root.read_int(f"{d}/cpu.cfs_quota_us"), root.read_int(f"{d}/cpu.cfs_period_us")
                if q1 is not None and q1 > 0:
                    p1 = p1 if p1 and p1 > 0 else 100000
                    quota = _min_opt(quota, q1 / p1)
                    sources.append(f"/{d}/cpu.cfs_quota_us = {q1} (period {p1})")
            elif controller == "memory":
                limit = root.read_int(f"{d}/memory.limit_in_bytes")
                if limit is not None and 0 < limit < _UNLIMITED_BYTES:
                    memory = _min_opt(memory, limit)
                    sources.append(f"/{d}/memory.limit_in_bytes = {limit}")
            elif cpuset is None:
                cpus = parse_cpu_list(root.read_line(f"{d}/cpuset.effective_cpus")) or parse_cpu_list(
                    root.read_line(f"{d}/cpuset.cpus")
                )
                if cpus is not None:
                    cpuset = cpus
    path = v1_paths.get("cpu") or v1_paths.get("memory") or "/"
    return CgroupLimits(
        1 if found_v1 else 0, path, quota, cpuset, None if memory is None else int(memory), tuple(sources)
    )


def resource_budget(online_cpus: int, memory: MemoryInfo, cgroup: CgroupLimits) -> ResourceBudget:
    host = max(online_cpus, 1)
    effective, reason = host, f"{host} online CPUs" if online_cpus else "CPU count unknown, assuming 1"
    if cgroup.cpuset is not None and len(cgroup.cpuset) < effective:
        effective, reason = (
            len(cgroup.cpuset),
            f"cgroup v{cgroup.version} cpuset allows {len(cgroup.cpuset)} CPUs",
        )
    if cgroup.cpu_quota is not None and math.ceil(cgroup.cpu_quota) < effective:
        effective = max(1, math.ceil(cgroup.cpu_quota))
        reason = f"cgroup v{cgroup.version} CPU quota {cgroup.cpu_quota:g} CPUs"
    mem, mem_reason = memory.total_bytes, "MemTotal" if memory.total_bytes else "memory size unknown"
    if cgroup.memory_limit is not None and (mem is None or cgroup.memory_limit < mem):
        mem, mem_reason = cgroup.memory_limit, f"cgroup v{cgroup.version} memory limit"
    return ResourceBudget(host, effective, reason, mem, mem_reason)
