"""NVIDIA Jetson (L4T/JetPack, module, SoC, iGPU, DLA where known) and discrete GPUs (driver, GPUs).

Sources and tables: HARDWARE.md §1.1-1.2 (jetson-stats' jetson_variables.py, NVIDIA docs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot, key_values

# L4T release -> JetPack, TensorRT, CUDA (first match on prefix wins; most specific first)
_L4T_TABLE: tuple[tuple[str, str, str, str], ...] = (
    ("36.4.4", "6.2.1", "10.3", "12.6"),
    ("36.4.3", "6.2", "10.3", "12.6"),
    ("36.4", "6.1", "10.3", "12.6"),
    ("36.3", "6.0", "8.6.2", "12.2"),
    ("35.6", "5.1.4", "8.5.2", "11.4"),
    ("35.5", "5.1.3", "8.5.2", "11.4"),
    ("35.4", "5.1.2", "8.5.2", "11.4"),
    ("35.3", "5.1.1", "8.5.2", "11.4"),
    ("35.2", "5.1", "8.5.2", "11.4"),
    ("32.7", "4.6.1", "8.2.1", "10.2"),
    ("32.6", "4.6", "8.0.1", "10.2"),
    ("32.5", "4.5", "7.1.3", "10.2"),
    ("38.4", "7.1", "", "13.0"),
    ("38.2", "7.0", "", "13.0"),
)
_SOC: dict[str, tuple[str, str]] = {  # SoC -> (family, CUDA compute capability)
    "tegra210": ("Nano/TX1", "5.3"),
    "tegra186": ("TX2", "6.2"),
    "tegra194": ("Xavier", "7.2"),
    "tegra234": ("Orin", "8.7"),
    "tegra264": ("Thor", "11.0"),
}
_CHIP_ID = {"33": "tegra210", "24": "tegra186", "25": "tegra194", "35": "tegra234"}
# module P-number -> (name, DLA cores or None where public sources conflict)
_MODULES: dict[str, tuple[str, int | None]] = {
    "p3767-0000": ("Jetson Orin NX 16GB", 2),
    "p3767-0001": ("Jetson Orin NX 8GB", 1),  # NVIDIA datasheet says 1, a vendor blog says 2
    "p3767-0003": ("Jetson Orin Nano 8GB", None),  # sources conflict (0 or 1): TensorRT decides at run time
    "p3767-0004": ("Jetson Orin Nano 4GB", None),
    "p3767-0005": ("Jetson Orin Nano Developer Kit", None),
    "p3701-0000": ("Jetson AGX Orin", 2),
    "p3701-0004": ("Jetson AGX Orin 32GB", 2),
    "p3701-0005": ("Jetson AGX Orin 64GB", 2),
    "p3701-0008": ("Jetson AGX Orin Industrial (IGX)", 2),
    "p3668": ("Jetson Xavier NX", 2),
    "p2888": ("Jetson AGX Xavier", 2),
    "p3448": ("Jetson Nano", 0),
    "p3310": ("Jetson TX2", 0),
    "p3834": ("Jetson AGX Thor", 0),
}
_GPU_DEVFREQ = {
    "57000000.gpu": "Nano/TX1 iGPU (Maxwell)",
    "ga10b": "Orin iGPU (Ampere)",
    "gv11b": "Xavier iGPU (Volta)",
    "gp10b": "TX2 iGPU (Pascal)",
    "gm20b": "Nano iGPU (Maxwell)",
    "gpu-gpc-0": "Thor iGPU (Blackwell)",
}
# dGPU marketing name fragment -> compute capability (for cache keys and display; CUDA is authoritative)
_DGPU_CC: tuple[tuple[str, str], ...] = (
    ("H200", "9.0"),
    ("H100", "9.0"),
    ("GH200", "9.0"),
    ("L40", "8.9"),
    ("L4", "8.9"),
    ("RTX 40", "8.9"),
    ("RTX 50", "12.0"),
    ("B200", "10.0"),
    ("A100", "8.0"),
    ("A30", "8.0"),
    ("A10", "8.6"),
    ("A2", "8.6"),
    ("RTX 30", "8.6"),
    ("RTX A", "8.6"),
    ("T4", "7.5"),
    ("RTX 20", "7.5"),
    ("V100", "7.0"),
)


@dataclass(frozen=True)
class JetsonInfo:
    l4t: str | None  # e.g. "36.4.3"
    jetpack: str | None  # e.g. "6.2"
    tensorrt: str | None  # TensorRT the JetPack ships (table), e.g. "10.3"
    cuda: str | None
    model: str | None  # device-tree model string
    module: str | None  # e.g. "Jetson Orin NX 16GB"
    p_number: str | None  # e.g. "p3767-0000"
    soc: str | None  # e.g. "tegra234"
    soc_family: str | None  # e.g. "Orin"
    compute_capability: str | None  # e.g. "8.7"
    gpu: str | None  # iGPU devfreq node, e.g. "17000000.ga10b"
    dla_cores: int | None  # None = unknown here (TensorRT's num_DLA_cores decides)
    evidence: tuple[str, ...]

    def summary(self) -> str:
        dla = "DLA unknown" if self.dla_cores is None else f"{self.dla_cores} DLA"
        jp = f"JetPack {self.jetpack}" if self.jetpack else "JetPack unknown"
        return (
            f"{self.module or self.model or 'NVIDIA Jetson'} ({self.soc or 'SoC unknown'}, "
            f"L4T {self.l4t or '?'}, {jp}, sm {self.compute_capability or '?'}, {dla})"
        )


@dataclass(frozen=True)
class NvidiaGpu:
    name: str
    bus: str | None
    minor: int | None
    uuid: str | None
    compute_capability: str | None


@dataclass(frozen=True)
class DGpuInfo:
    driver: str | None
    gpus: tuple[NvidiaGpu, ...]
    device_nodes: tuple[str, ...]

    def summary(self) -> str:
        names = ", ".join(g.name for g in self.gpus) or f"{len(self.device_nodes)} device node(s)"
        return f"NVIDIA driver {self.driver or '?'}: {names}"


def l4t_from_release(text: str | None) -> str | None:
    """'# R36 (release), REVISION: 4.3, ...' -> '36.4.3'."""
    if not text:
        return None
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    if match is None:
        return None
    return f"{match.group(1)}.{match.group(2).strip('.')}"


def jetpack_for(l4t: str | None) -> tuple[str | None, str | None, str | None]:
    if not l4t:
        return None, None, None
    for prefix, jetpack, trt, cuda in _L4T_TABLE:
        if l4t == prefix or l4t.startswith(prefix + "."):
            return jetpack, trt or None, cuda
    return None, None, None


def probe_jetson(root: FsRoot) -> JetsonInfo | None:
    evidence: list[str] = []
    compatible = root.read_nul_list("proc/device-tree/compatible") or root.read_nul_list(
        "sys/firmware/devicetree/base/compatible"
    )
    soc = next((c.split(",", 1)[1] for c in compatible if c.startswith("nvidia,tegra")), None)
    if soc:
        evidence.append("device-tree compatible")
    release = root.read_text("etc/nv_tegra_release")
    l4t = l4t_from_release(release)
    if l4t:
        evidence.append("/etc/nv_tegra_release")
    chip = root.read_line("sys/module/tegra_fuse/parameters/tegra_chip_id")
    if chip:
        evidence.append("tegra_chip_id")
        soc = soc or _CHIP_ID.get(chip)
    gpu = next((d for d in root.listdir("sys/class/devfreq") if any(k in d for k in _GPU_DEVFREQ)), None)
    if gpu:
        evidence.append(f"devfreq {gpu}")
        if soc is None and "gpu-gpc-0" in gpu:
            soc = "tegra264"
    if not evidence:
        return None
    if soc is None and l4t and l4t.startswith("38"):
        soc = "tegra264"
    model = root.read_line("proc/device-tree/model") or root.read_line("sys/firmware/devicetree/base/model")

    p_number = None
    for entry in compatible:  # the entry without '+' is the module; "nvidia,p3767-0000" -> p3767-0000
        name = entry.split(",", 1)[-1]
        if entry.startswith("nvidia,p") and "+" not in entry:
            p_number = name
            break
    if p_number is None:
        for entry in compatible:  # carrier+module: take the part after '+'
            if entry.startswith("nvidia,p") and "+" in entry:
                p_number = entry.split("+", 1)[1].removesuffix("-super")
                break
    module, dla = None, None
    if p_number:
        key = p_number if p_number in _MODULES else p_number.split("-", 1)[0]
        module, dla = _MODULES.get(key, (None, None))
    if model and "super" in model.lower() and module and "Super" not in module:
        module += " (Super)"
    jetpack, trt, cuda = jetpack_for(l4t)
    family, cc = _SOC.get(soc or "", (None, None))
    return JetsonInfo(
        l4t, jetpack, trt, cuda, model, module, p_number, soc, family, cc, gpu, dla, tuple(evidence)
    )


def _cc_for(name: str) -> str | None:
    upper = name.upper()
    for fragment, cc in _DGPU_CC:
        if fragment.upper() in upper:
            return cc
    return None


def probe_dgpu(root: FsRoot) -> DGpuInfo | None:
    version = root.read_text("proc/driver/nvidia/version")
    driver = None
    if version:
        match = re.search(r"Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", version) or re.search(
            r"(\d+\.\d+(?:\.\d+)?)", version
        )
        driver = match.group(1) if match else None
    driver = driver or root.read_line("sys/module/nvidia/version")
    gpus: list[NvidiaGpu] = []
    for bus in root.listdir("proc/driver/nvidia/gpus"):
        info = key_values(root.read_text(f"proc/driver/nvidia/gpus/{bus}/information"))
        if not info:
            continue
        name = info.get("Model", "NVIDIA GPU")
        minor = info.get("Device Minor", "")
        gpus.append(
            NvidiaGpu(
                name,
                info.get("Bus Location", bus),
                int(minor) if minor.isdigit() else None,
                info.get("GPU UUID"),
                _cc_for(name),
            )
        )
    nodes = tuple(f"/dev/{n}" for n in root.listdir("dev") if re.fullmatch(r"nvidia\d+", n))
    if not gpus and not nodes:
        return None  # a driver without GPUs (or a Jetson's nvgpu) is not a dGPU box
    return DGpuInfo(driver, tuple(gpus), nodes)
