"""What a device accepts, beyond a good signature: fresh, newer, for this hardware and edgeserve
version, within size caps, and fitting on the disk."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edgeserve import __version__
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import Manifest

ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}


@dataclass(frozen=True)
class Policy:
    max_unpacked_bytes: int = 16 * 2**30  # a bundle larger than this is refused, whatever it declares
    max_files: int = 10_000
    disk_margin_bytes: int = 64 * 2**20  # kept free after download + unpack + the kept version


def normal_arch(name: str) -> str:
    return ARCH_ALIASES.get(name.lower(), name.lower())


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def check_manifest(
    manifest: Manifest,
    *,
    installed_versions: dict[str, int],
    policy: Policy,
    security_floor: int = 0,
    arch: str | None = None,
    accelerators: set[str] | None = None,
    now: datetime | None = None,
) -> None:
    """Refuse an expired, replayed, older, oversized or incompatible bundle (each its own reason).
    `security_floor` is the highest security_version this device ever committed, whatever the name."""
    moment = now or datetime.now(timezone.utc)
    if manifest.expires_at <= moment:
        raise BundleRefused(
            "expired",
            f"bundle {manifest.name} v{manifest.version} expired at {manifest.expires_at:%Y-%m-%dT%H:%M:%SZ}",
        )
    highest = installed_versions.get(manifest.name, 0)
    if manifest.version == highest:
        raise BundleRefused("replay", f"{manifest.name} v{manifest.version} is already installed")
    if manifest.version < highest:
        raise BundleRefused(
            "downgrade",
            f"{manifest.name} v{manifest.version} is older than installed v{highest} "
            "(roll back explicitly instead)",
        )
    if manifest.security_version < security_floor:
        raise BundleRefused(
            "security_version",
            f"{manifest.name} v{manifest.version} has security_version {manifest.security_version}, below "
            f"this device's floor of {security_floor} (roll back explicitly to a kept version instead)",
        )
    here = normal_arch(arch or platform.machine())
    if here not in {normal_arch(a) for a in manifest.arch}:
        raise BundleRefused("incompatible", f"built for {', '.join(manifest.arch)}, this device is {here}")
    if manifest.accelerators:
        present = accelerators or set()
        if not present & {a.lower() for a in manifest.accelerators}:
            have = ", ".join(sorted(present)) or "none"
            raise BundleRefused(
                "incompatible", f"needs one of {', '.join(manifest.accelerators)}; this device has {have}"
            )
    if _version_tuple(__version__) < _version_tuple(manifest.min_edgeserve):
        raise BundleRefused(
            "incompatible", f"needs edgeserve >= {manifest.min_edgeserve}, this is {__version__}"
        )
    if manifest.unpacked_size > policy.max_unpacked_bytes:
        raise BundleRefused(
            "oversized",
            f"unpacks to {manifest.unpacked_size} bytes, over the policy cap of {policy.max_unpacked_bytes}",
        )
    if len(manifest.files) > policy.max_files:
        raise BundleRefused(
            "oversized", f"{len(manifest.files)} files, over the policy cap of {policy.max_files}"
        )


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_bavail * stats.f_frsize


def check_disk(where: Path, need_bytes: int, policy: Policy, what: str) -> None:
    """statvfs preflight: `need_bytes` plus the margin must fit."""
    free = free_bytes(where)
    if free < need_bytes + policy.disk_margin_bytes:
        raise BundleRefused(
            "disk",
            f"not enough disk for {what}: need {need_bytes + policy.disk_margin_bytes} bytes with the "
            f"margin, {free} free in {where}",
        )
