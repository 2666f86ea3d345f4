"""Shared pieces of the bundle attack tests: paths to the OTA test helpers, crafted bundles signed by the
device's trusted key, a device's store as a tree, a LAN address of this machine, a small tmpfs."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for folder in (TESTS, TESTS / "ota", TESTS / "fleet", TESTS / "supervisor"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# Re-exported: the tests import them from here, so that this module (which sets sys.path) comes first.
import fleet_keys as fleet_keys  # noqa: E402
from appliance import Appliance as Appliance  # noqa: E402
from appliance import start_appliance as start_appliance  # noqa: E402
from appliance import wait_until as wait_until  # noqa: E402
from broker import Mosquitto as Mosquitto  # noqa: E402
from broker import find_mosquitto as find_mosquitto  # noqa: E402
from broker import needs_mosquitto as needs_mosquitto  # noqa: E402
from hostile import Bundle, Signer, directory, manifest_for, regular  # noqa: E402
from ota_fixtures import Fleet  # noqa: E402

from edgeserve.ota.installer import Installer, Outcome  # noqa: E402
from edgeserve.ota.policy import Policy  # noqa: E402
from edgeserve.ota.signing import key_id, load_public  # noqa: E402
from edgeserve.ota.store import Store  # noqa: E402
from edgeserve.ota.url_policy import UrlPolicy  # noqa: E402
from edgeserve.supervisor.activate import OfflineActivator, TrialRunner  # noqa: E402

MB = 2**20


def signer_of(fleet: Fleet) -> Signer:
    """The fleet's key (trusted by the device) as a hostile.Signer: a compromised build host."""
    return Signer(fleet.key, fleet.public, key_id(load_public(fleet.public)))


def crafted(fleet: Fleet, out: Path, *, version: int = 1, name: str = "vision", folders: tuple[str, ...] = (),
            files: dict[str, bytes] | None = None, **manifest: Any) -> Path:  # fmt: skip
    """A bundle signed by the trusted key: `files` (default: the mlp model of fleet.repo), the folder
    members their paths imply, then `folders` (extra folder members, as an attacker adds them)."""
    if files is None:
        repo = fleet.repo(version, {"mlp": {"builder": "mlp", "seed": version}})
        files = {
            f"models/{p.relative_to(repo).as_posix()}": p.read_bytes()
            for p in sorted(repo.rglob("*"))
            if p.is_file()
        }
    from datetime import datetime, timezone

    signer = signer_of(fleet)
    data = manifest_for(list(files.items()), key_id=signer.key_id, now=datetime.now(timezone.utc), name=name,
                        version=version, **manifest)  # fmt: skip
    implied = sorted({str(parent) for path in files for parent in Path(path).parents} - {"."})
    members = [directory(folder + "/") for folder in implied]
    members += [regular(path, body) for path, body in files.items()]
    members += [directory(folder) for folder in folders]
    return Bundle(data, members).write(out, signer)


def tree(root: Path) -> dict[str, int]:
    """Every path under `root` with its size (folders 0); links are not followed."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.lstat().st_size if p.is_file() and not p.is_symlink() else 0)
        for p in sorted(root.rglob("*"))
    }


def downloads(state: Path) -> list[str]:
    folder = state / "ota" / "downloads"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def installer(state: Path, *, policy: Policy | None = None, urls: UrlPolicy | None = None) -> Installer:
    """The device's installer, with a real trial server (started only for a bundle that passed the checks)."""
    trial = OfflineActivator(TrialRunner(state, None, window_s=0.5))
    return Installer(Store(state), trial, policy=policy, url_policy=urls)


def install(state: Path, source: str, **kwargs: Any) -> Outcome:
    options = {k: kwargs.pop(k) for k in ("policy", "urls") if k in kwargs}
    return installer(state, **options).install(source, lambda *a: None, **kwargs)


def lan_address() -> str | None:
    """An IPv4 address of this machine that the URL policy allows (a LAN or public one), or None."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            if (
                entry.family == socket.AF_INET
                and UrlPolicy().refusal(ipaddress.ip_address(entry.address)) is None
            ):
                return str(entry.address)
    return None


@contextmanager
def small_tmpfs(mountpoint: Path, size: str) -> Iterator[Path | str]:
    """A tmpfs of `size` mounted at `mountpoint` (root in the test container); yields the mount error
    text instead when it cannot be mounted."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mountpoint)],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        yield f"cannot mount a tmpfs: {exc}"
        return
    if done.returncode != 0:
        yield f"cannot mount a tmpfs: {done.stderr.strip() or done.returncode}"
        return
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=20, check=False)
