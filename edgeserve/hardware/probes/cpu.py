"""CPU: architecture, model, ISA features (AVX2/AVX-512/VNNI/AMX, NEON/dot-product/SVE), online CPUs."""

from __future__ import annotations

import platform
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot, parse_cpu_list

# /proc/cpuinfo token -> normalized ISA name (x86 `flags`, ARM `Features`)
_X86_ISA: dict[str, str] = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512",
    "avx512bw": "avx512bw",
    "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
    "avx512_bf16": "avx512_bf16",
    "avx512_fp16": "avx512_fp16",
    "amx_tile": "amx",
    "amx_bf16": "amx_bf16",
    "amx_int8": "amx_int8",
    "amx_fp16": "amx_fp16",
}
_ARM_ISA: dict[str, str] = {
    "asimd": "neon",
    "asimddp": "dotprod",
    "fphp": "fp16",
    "asimdhp": "fp16",
    "bf16": "bf16",
    "i8mm": "i8mm",
    "sve": "sve",
    "sve2": "sve2",
}
# MIDR (implementer, part) -> core name; from jetson-stats' table and ARM TRMs
_ARM_PARTS: dict[tuple[str, str], str] = {
    ("0x41", "0xd03"): "Cortex-A53",
    ("0x41", "0xd04"): "Cortex-A35",
    ("0x41", "0xd05"): "Cortex-A55",
    ("0x41", "0xd07"): "Cortex-A57",
    ("0x41", "0xd08"): "Cortex-A72",
    ("0x41", "0xd09"): "Cortex-A73",
    ("0x41", "0xd0a"): "Cortex-A75",
    ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1",
    ("0x41", "0xd0d"): "Cortex-A77",
    ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd41"): "Cortex-A78",
    ("0x41", "0xd42"): "Cortex-A78AE",
    ("0x41", "0xd44"): "Cortex-X1",
    ("0x41", "0xd49"): "Neoverse-N2",
    ("0x41", "0xd4f"): "Neoverse-V2",
    ("0x41", "0xd80"): "Cortex-A520",
    ("0x41", "0xd81"): "Cortex-A720",
    ("0x4e", "0x004"): "NVIDIA Carmel",
    ("0x4e", "0x003"): "NVIDIA Denver 2",
}
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64", "armv8l": "aarch64", "i686": "x86", "i386": "x86"}


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # x86_64 | aarch64 | armv7l | ... | unknown
    vendor: str | None
    model_name: str | None
    online_cpus: int  # 0 = unknown
    isa: tuple[str, ...]  # normalized features, see _X86_ISA / _ARM_ISA values
    core_types: tuple[str, ...]  # ARM core names from MIDR, e.g. ("Cortex-A78AE",)
    sve_vector_length: int | None

    def has(self, *features: str) -> bool:
        """True when every named feature is present."""
        return all(f in self.isa for f in features)

    @property
    def bf16(self) -> bool:
        """Native bf16 compute (what OpenVINO's CPU plugin needs to run bf16 for real)."""
        return (
            "avx512_bf16" in self.isa
            or "amx_bf16" in self.isa
            or (self.arch == "aarch64" and "bf16" in self.isa)
        )

    @property
    def fp16(self) -> bool:
        """Native fp16 arithmetic on the CPU (ARMv8.2 FP16, x86 AVX512-FP16/AMX-FP16)."""
        if self.arch == "aarch64":
            return "fp16" in self.isa
        return "avx512_fp16" in self.isa or "amx_fp16" in self.isa

    def summary(self) -> str:
        name = self.model_name or (", ".join(self.core_types) if self.core_types else "unknown CPU")
        cpus = f"{self.online_cpus} CPUs" if self.online_cpus else "CPU count unknown"
        isa = " ".join(self.isa) if self.isa else "no notable ISA extensions"
        return f"{self.arch} {name}, {cpus}; {isa}"


def _blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append({})
            continue
        key, found, value = line.partition(":")
        if found:
            blocks[-1].setdefault(key.strip().lower(), value.strip())
    return [b for b in blocks if b]


def probe_cpu(root: FsRoot) -> CpuInfo:
    text = root.read_text("proc/cpuinfo") or ""
    blocks = _blocks(text)
    merged: dict[str, str] = {}
    for block in blocks:
        for key, value in block.items():
            merged.setdefault(key, value)

    # On this box the userland's architecture is what runs the runtimes (a 32-bit userland on a 64-bit
    # kernel, or an emulated one, reports the kernel's arch in /proc); captured trees use the file.
    arch = platform.machine() if root.is_live else ""
    arch = arch or (root.read_line("proc/sys/kernel/arch") or "").strip()
    if not arch:
        if "flags" in merged:
            arch = "x86_64" if " lm " in f" {merged['flags']} " else "x86"
        elif "features" in merged or "cpu implementer" in merged:
            arch = (
                "aarch64"
                if "cpu architecture" not in merged or merged["cpu architecture"] == "8"
                else "armv7l"
            )
        elif root.is_live:
            arch = platform.machine()
        else:
            arch = "unknown"
    arch = _ARCH_ALIASES.get(arch.lower(), arch.lower())

    isa: list[str] = []
    tokens = set((merged.get("flags") or merged.get("features") or "").split())
    table = _ARM_ISA if arch.startswith("aarch") or arch.startswith("arm") else _X86_ISA
    for token, name in table.items():
        if token in tokens and name not in isa:
            isa.append(name)

    core_types: list[str] = []
    for block in blocks:
        implementer, part = block.get("cpu implementer", "").lower(), block.get("cpu part", "").lower()
        if implementer and part:
            name = _ARM_PARTS.get((implementer, part), f"ARM {implementer}/{part}")
            if name not in core_types:
                core_types.append(name)

    online = parse_cpu_list(root.read_line("sys/devices/system/cpu/online"))
    processors = sum(1 for b in blocks if "processor" in b and b["processor"].isdigit())
    online_cpus = len(online) if online else processors

    vendor = merged.get("vendor_id") or (
        {"0x41": "ARM", "0x4e": "NVIDIA", "0x51": "Qualcomm", "0x61": "Apple"}.get(
            merged.get("cpu implementer", "").lower()
        )
    )
    model_name = merged.get("model name") or merged.get("hardware") or None
    return CpuInfo(
        arch=arch,
        vendor=vendor,
        model_name=model_name,
        online_cpus=online_cpus,
        isa=tuple(isa),
        core_types=tuple(core_types),
        sve_vector_length=root.read_int("proc/sys/abi/sve_default_vector_length"),
    )
