"""Intel iGPU (DRM render nodes, i915/xe) and NPU (accel nodes, intel_vpu) for OpenVINO's GPU/NPU plugins."""

from __future__ import annotations

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


def probe_intel(root: FsRoot) -> IntelAccelInfo:
    gpus: list[IntelDevice] = []
    for name in root.listdir("sys/class/drm"):
        if not name.startswith("renderD"):
            continue
        sysdev = f"sys/class/drm/{name}/device"
        vendor = (root.read_line(f"{sysdev}/vendor") or "").lower()
        driver = _driver(root, sysdev)
        if vendor == INTEL_VENDOR or driver in _GPU_DRIVERS:
            gpus.append(
                IntelDevice(
                    f"/dev/dri/{name}",
                    driver,
                    root.read_line(f"{sysdev}/device"),
                    root.exists(f"dev/dri/{name}"),
                )
            )
    npus: list[IntelDevice] = []
    for name in root.listdir("sys/class/accel"):
        sysdev = f"sys/class/accel/{name}/device"
        vendor = (root.read_line(f"{sysdev}/vendor") or "").lower()
        driver = _driver(root, sysdev)
        if driver in _NPU_DRIVERS or (vendor == INTEL_VENDOR and driver is None):
            npus.append(
                IntelDevice(
                    f"/dev/accel/{name}",
                    driver,
                    root.read_line(f"{sysdev}/device"),
                    root.exists(f"dev/accel/{name}"),
                )
            )
    return IntelAccelInfo(tuple(gpus), tuple(npus))
