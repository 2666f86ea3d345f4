"""Board model: device tree (Raspberry Pi, Rockchip, Jetson, other ARM) or DMI (x86); add-on accelerators."""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot

_ADDON_NODES = {"hailo": "Hailo", "apex_": "Google Coral (Edge TPU)"}


@dataclass(frozen=True)
class BoardInfo:
    model: str | None  # device-tree model or DMI product
    vendor: str | None
    compatible: tuple[str, ...]
    family: str | None  # raspberrypi | rockchip | jetson | x86 | arm | None
    soc: str | None  # bcm2712, rk3588, tegra234 ... (last device-tree compatible entry)
    addons: tuple[str, ...]  # accelerators seen as device nodes, e.g. ("Hailo /dev/hailo0",)

    def summary(self) -> str:
        text = self.model or "unknown board"
        if self.soc:
            text += f" ({self.soc})"
        if self.addons:
            text += "; add-ons: " + ", ".join(self.addons)
        return text


def probe_board(root: FsRoot) -> BoardInfo:
    compatible = root.read_nul_list("proc/device-tree/compatible") or root.read_nul_list(
        "sys/firmware/devicetree/base/compatible"
    )
    model = root.read_line("proc/device-tree/model") or root.read_line("sys/firmware/devicetree/base/model")
    vendor = None
    family: str | None = None
    soc = compatible[-1].split(",", 1)[-1] if compatible else None
    if compatible:
        vendors = {c.split(",", 1)[0] for c in compatible}
        if "raspberrypi" in vendors or (model or "").startswith("Raspberry Pi"):
            family, vendor = "raspberrypi", "Raspberry Pi"
        elif "rockchip" in vendors:
            family, vendor = "rockchip", "Rockchip"
            soc = next((c.split(",", 1)[1] for c in reversed(compatible) if c.startswith("rockchip,rk")), soc)
        elif any(c.startswith("nvidia,tegra") for c in compatible):
            family, vendor = "jetson", "NVIDIA"
            soc = next(c.split(",", 1)[1] for c in compatible if c.startswith("nvidia,tegra"))
        else:
            family, vendor = "arm", compatible[0].split(",", 1)[0]
    else:
        vendor = root.read_line("sys/devices/virtual/dmi/id/sys_vendor")
        product = root.read_line("sys/devices/virtual/dmi/id/product_name")
        board = root.read_line("sys/devices/virtual/dmi/id/board_name")
        model = model or product or board
        family = "x86" if (vendor or model) else None
    addons = tuple(
        f"{label} /dev/{node}"
        for node in root.listdir("dev")
        for prefix, label in _ADDON_NODES.items()
        if node.startswith(prefix)
    )
    return BoardInfo(model, vendor, compatible, family, soc, addons)
