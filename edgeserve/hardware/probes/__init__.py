"""Probes: pure functions over a filesystem root (`/` on a device, a fixture tree in tests).

`probe_hardware(root)` runs them all. Unknown or unreadable files degrade to "absent", never raise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.hardware.probes._fs import FsRoot
from edgeserve.hardware.probes.board import BoardInfo, probe_board
from edgeserve.hardware.probes.cpu import CpuInfo, probe_cpu
from edgeserve.hardware.probes.intel import IntelAccelInfo, probe_intel
from edgeserve.hardware.probes.memory import (
    CgroupLimits,
    MemoryInfo,
    ResourceBudget,
    probe_cgroup,
    probe_memory,
    resource_budget,
)
from edgeserve.hardware.probes.neuron import NeuronInfo, probe_neuron
from edgeserve.hardware.probes.nvidia import DGpuInfo, JetsonInfo, probe_dgpu, probe_jetson
from edgeserve.hardware.probes.thermal import ThermalZone, probe_thermal

__all__ = [
    "BoardInfo",
    "CgroupLimits",
    "CpuInfo",
    "DGpuInfo",
    "FsRoot",
    "HardwareInfo",
    "IntelAccelInfo",
    "JetsonInfo",
    "MemoryInfo",
    "NeuronInfo",
    "ResourceBudget",
    "ThermalZone",
    "probe_hardware",
]


@dataclass(frozen=True)
class HardwareInfo:
    root: str
    kernel: str | None
    cpu: CpuInfo
    memory: MemoryInfo
    cgroup: CgroupLimits
    budget: ResourceBudget
    board: BoardInfo
    jetson: JetsonInfo | None
    nvidia_dgpu: DGpuInfo | None
    intel: IntelAccelInfo
    neuron: NeuronInfo | None
    thermal: tuple[ThermalZone, ...]

    @property
    def is_live(self) -> bool:
        return FsRoot(self.root).is_live

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary_lines(self) -> list[str]:
        def gib(b: int) -> str:
            return f"{b / 2**30:.1f} GiB"

        lines = [f"cpu:      {self.cpu.summary()}"]
        budget = self.budget
        mem = gib(budget.memory_bytes) if budget.memory_bytes else "unknown"
        lines.append(
            f"budget:   {budget.effective_cpus} CPUs ({budget.cpu_reason}), memory {mem} "
            f"({budget.memory_reason})"
        )
        lines.append(f"board:    {self.board.summary()}")
        if self.kernel:
            lines.append(f"kernel:   {self.kernel}")
        if self.jetson:
            lines.append(f"jetson:   {self.jetson.summary()}")
        if self.nvidia_dgpu:
            lines.append(f"nvidia:   {self.nvidia_dgpu.summary()}")
        if self.intel.gpus or self.intel.npus:
            lines.append(f"intel:    {self.intel.summary()}")
        if self.neuron:
            lines.append(f"neuron:   {self.neuron.summary()}")
        temps = [f"{z.kind} {z.temp_c:.0f}°C" for z in self.thermal if z.temp_c is not None]
        if temps:
            lines.append("thermal:  " + ", ".join(temps[:6]) + (" ..." if len(temps) > 6 else ""))
        return lines


def probe_hardware(root: Path | str = "/") -> HardwareInfo:
    fs = FsRoot(root)
    cpu = probe_cpu(fs)
    memory = probe_memory(fs)
    cgroup = probe_cgroup(fs)
    return HardwareInfo(
        root=str(fs.root),
        kernel=fs.read_line("proc/sys/kernel/osrelease"),
        cpu=cpu,
        memory=memory,
        cgroup=cgroup,
        budget=resource_budget(cpu.online_cpus, memory, cgroup),
        board=probe_board(fs),
        jetson=probe_jetson(fs),
        nvidia_dgpu=probe_dgpu(fs),
        intel=probe_intel(fs),
        neuron=probe_neuron(fs),
        thermal=probe_thermal(fs),
    )
