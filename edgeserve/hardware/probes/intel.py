"""Intel iGPU (DRM render nodes, i915/xe) and NPU (accel nodes, intel_vpu) for OpenVINO's GPU/NPU plugins."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot, key_values

INTEL_VENDOR = "0x8086"
_GPU_DRIVERS = ("i915", "xe")
_NPU_DRIVERS = ("intel_vpu",)


@dataclass(frozen=True)
class IntelDevice:
    node: str  # /dev/dri/renderD128 or /dev/accel/accel0
    driver: str | None
    device_id: str | None  # PCI device id, e.g. 0x7d55
    node_present: bool  # the /dev node exists (containers need --device)


@dataclass(frozen=True)
class IntelAccelInfo:
    gpus: tuple[IntelDevice, ...]
    npus: tuple[IntelDevice, ...]

    def summary(self) -> str:
        parts = [f"iGPU {g.node} ({g.driver or 'driver ?'})" for g in self.gpus]
        parts += [f"NPU {n.node} ({n.driver or 'driver ?'})" for n in self.npus]
        return ", ".join(parts) or "none"


def _driver(root: FsRoot, sysdev: str) -> str | None:
    uevent = key_values(root.read_text(f"{sysdev}/uevent"), sep="=")
    return (
        uevent.get("DRIVER") or root.readlink_name(f"{sysdev}/driver") or root.read_line(f"{sysdev}/driver")
    )


def _nodes(root: FsRoot, klass: str, dev_dir: str, prefix: str = "") -> Iterator[tuple[IntelDevice, str]]:
    """(device, PCI vendor) for each sys/class/<klass> node named <prefix>..., any vendor."""
    for name in root.listdir(f"sys/class/{klass}"):
        if not name.startswith(prefix):
            continue
        sysdev = f"sys/class/{klass}/{name}/device"
        vendor = (root.read_line(f"{sysdev}/vendor") or "").lower()
        node = f"dev/{dev_dir}/{name}"
        device = IntelDevice(
            f"/{node}", _driver(root, sysdev), root.read_line(f"{sysdev}/device"), root.exists(node)
        )
        yield device, vendor


def probe_intel(root: FsRoot) -> IntelAccelInfo:
    gpus = tuple(
        gpu
        for gpu, vendor in _nodes(root, "drm", "dri", "renderD")
        if vendor == INTEL_VENDOR or gpu.driver in _GPU_DRIVERS
    )
    npus = tuple(
        npu
        for npu, vendor in _nodes(root, "accel", "accel")
        if npu.driver in _NPU_DRIVERS or (vendor == INTEL_VENDOR and npu.driver is None)
    )
    return IntelAccelInfo(gpus, npus)
