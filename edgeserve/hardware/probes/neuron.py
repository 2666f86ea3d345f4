"""AWS Inferentia/Trainium: /dev/neuronN device nodes, the neuron driver, the EC2 instance type (DMI)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeserve.hardware.probes._fs import FsRoot

# instance family -> NeuronCores per device (Inf1: NeuronCore-v1 x4; Inf2/Trn1: v2 x2; Trn2: v3 x8 physical)
_CORES_PER_DEVICE = {"inf1": 4, "inf2": 2, "trn1": 2, "trn1n": 2, "trn2": 8, "trn2n": 8}


@dataclass(frozen=True)
class NeuronInfo:
    devices: tuple[str, ...]  # /dev/neuron0 ...
    driver: str | None  # aws-neuronx-dkms module version
    instance_type: str | None  # e.g. inf2.xlarge (DMI product_name on Nitro instances)
    cores_per_device: int | None  # None = instance family unknown here

    @property
    def cores(self) -> int | None:
        return None if self.cores_per_device is None else self.cores_per_device * len(self.devices)

    def summary(self) -> str:
        cores = f", {self.cores} NeuronCores" if self.cores else ""
        return f"{len(self.devices)} Neuron device(s){cores} ({self.instance_type or 'instance type ?'})"


def probe_neuron(root: FsRoot) -> NeuronInfo | None:
    devices = tuple(f"/dev/{n}" for n in root.listdir("dev") if re.fullmatch(r"neuron\d+", n))
    if not devices:
        return None
    vendor = root.read_line("sys/devices/virtual/dmi/id/sys_vendor") or ""
    product = root.read_line("sys/devices/virtual/dmi/id/product_name")
    instance = (
        product if product and ("Amazon" in vendor or re.fullmatch(r"[a-z0-9]+\.\w+", product)) else None
    )
    family = instance.split(".", 1)[0] if instance else None
    return NeuronInfo(
        devices, root.read_line("sys/module/neuron/version"), instance, _CORES_PER_DEVICE.get(family or "")
    )
