"""The device's bundle store under `<state_dir>/ota/` and its journal.

    ota/journal.json           the install in progress (state, versions, the link it replaces) and the history
    ota/bundles/<name>-v<N>/   unpacked, verified bundles (manifest.json, manifest.sig, models/); never
                               edited once renamed in from staging, writable by the service user only,
                               checked against the manifest before a model of it loads
    ota/current -> bundles/..  what the server serves (one rename switches it)
    ota/previous -> bundles/.. kept for rollback
    ota/staging/<id>/          a fresh extraction folder per install
    ota/downloads/             the running install's download (.part while it arrives); nothing else
    revoked-keys.json          keys revoked by the fleet (ota/trust.py); the trusted keys are in
                               [ota] trust_dir (default <state_dir>/trust), see ota/trust.py

Every journal write is fsync'd before the step it announces, so after a power cut `recover()` knows
exactly what was under way and undoes it: the old bundle serves, whole. The journal also holds what must
never go backwards: the highest version committed per bundle name (`installed`) and the highest
`security_version` committed under any name (`security_floor`), each raised in the same atomic write
that records the commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.fsutil import fsync_dir, private_mkdir, replace_symlink, seal_tree, write_json_atomic
from edgeserve.ota.errors import StoreError
from edgeserve.ota.trust import TrustStore, default_trust_dir
from edgeserve.repository import bundle_files

log = logging.getLogger("edgeserve.ota")

DOWNLOADING, VERIFYING, STAGED, LOADING, TRIAL = "DOWNLOADING", "VERIFYING", "STAGED", "LOADING", "TRIAL"
COMMITTED, ROLLING_BACK, FAILED, ROLLED_BACK = "COMMITTED", "ROLLING_BACK", "FAILED", "ROLLED_BACK"
HISTORY_KEPT = 50


@dataclass(frozen=True)
class Version:
    name: str
    version: int
    path: Path

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version}"


# A download and what download.py writes beside it while it arrives.
DOWNLOAD_SUFFIXES = ("", ".part", ".part.meta", ".part.meta.tmp")


def download_of(filename: str) -> str:
    """The download a file in downloads/ belongs to."""
    for suffix in sorted(DOWNLOAD_SUFFIXES, key=len, reverse=True):  # the longest suffix that matches
        if suffix and filename.endswith(suffix):
            return filename[: -len(suffix)]
    return filename


def _floor(journal: dict[str, Any]) -> int:
    value = journal.get("security_floor", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _parse_dirname(dirname: str) -> tuple[str, int] | None:
    name, sep, number = dirname.rpartition("-v")
    return (name, int(number)) if sep and number.isdigit() else None


class Store:
    def __init__(self, state_dir: Path, trust_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.root = state_dir / "ota"
        self.trust = TrustStore(trust_dir or default_trust_dir(state_dir), state_dir)
        self.bundles = self.root / "bundles"
        self.staging = self.root / "staging"
        self.downloads = self.root / "downloads"
        self.journal_path = self.root / "journal.json"
        self.current_link = self.root / "current"
        self.previous_link = self.root / "previous"

    def ensure(self) -> None:
        # Not the trust folder: it may be read-only (/etc/edgeserve/trust under systemd).
        # Owner-only whatever the umask: under systemd (UMask=0007) a group member could otherwise swap
        # a bundle's files, the links or the journal.
        for folder in (self.root, self.bundles, self.staging, self.downloads):
            private_mkdir(folder)

    # -- journal ----------------------------------------------------------------------------------
    def journal(self) -> dict[str, Any]:
        import json

        data: Any
        try:
            data = json.loads(self.journal_path.read_text())
        except FileNotFoundError:
            data = {}
        except ValueError:  # cannot happen with atomic writes; never let it stop a device
            log.error("journal %s is unreadable; starting a new one", self.journal_path)
            data = {}
        if not isinstance(data, dict):
            data = {}
        data.setdefault("install", None)
        data.setdefault("history", [])
        data.setdefault("installed", {})
        journal: dict[str, Any] = data
        return journal

    def write_journal(self, data: dict[str, Any]) -> None:
        data["history"] = data["history"][-HISTORY_KEPT:]
        write_json_atomic(self.journal_path, data)

    def begin(self, source: str, **fields: Any) -> dict[str, Any]:
        journal = self.journal()
        if journal["install"] is not None:
            raise StoreError(f"another install is recorded as running: {journal['install'].get('id')}")
        record = {"id": uuid.uuid4().hex[:12], "source": source, "state": DOWNLOADING,
                  "started_at": time.time(), "transitions": [[DOWNLOADING, time.time()]]}  # fmt: skip
        record.update(fields)
        journal["install"] = record
        journal.pop("resumable", None)  # the downloads folder is this install's now
        self.write_journal(journal)
        return record

    def transition(self, state: str, **fields: Any) -> dict[str, Any]:
        journal = self.journal()
        record = journal["install"]
        if record is None:
            raise StoreError("no install is running")
        record.update(fields)
        record["state"] = state
        record["transitions"].append([state, time.time()])
        self.write_journal(journal)
        return dict(record)

    def finish(
        self,
        outcome: str,
        reason: str = "",
        installed: tuple[str, int] | None = None,
        security_version: int = 0,
    ) -> dict[str, Any]:
        """End the install with a terminal state; it goes to the history. A commit (`installed`) raises the
        version high-water marks in the same atomic write."""
        journal = self.journal()
        record = journal["install"] or {}
        record.update({"state": outcome, "finished_at": time.time(), "reason": reason})
        record.setdefault("transitions", []).append([outcome, time.time()])
        journal["history"].append(record)
        journal["install"] = None
        if installed is not None:
            name, version = installed
            journal["installed"][name] = max(version, int(journal["installed"].get(name, 0)))
            journal["security_floor"] = max(security_version, _floor(journal))
        self.write_journal(journal)
        return record

    def security_floor(self) -> int:
        """The lowest security_version this device still installs: the highest it committed, and never
        below what serves now (should the journal ever be lost)."""
        active = self.active()
        serving = 0
        if active is not None:
            import json

            try:
                value = json.loads((active.path / "manifest.json").read_bytes()).get("security_version", 0)
                serving = value if isinstance(value, int) and not isinstance(value, bool) else 0
            except (OSError, ValueError, AttributeError):
                pass
        return max(_floor(self.journal()), serving)

    def mark_resumable(self, download: str, source: str) -> None:
        """A download a restart cut off: kept (only it) for the next install of the same URL to resume."""
        journal = self.journal()
        journal["resumable"] = {"download": download, "source": source}
        self.write_journal(journal)

    def remove_download(self, name: str) -> None:
        """The file and what download.py keeps beside it while it arrives."""
        for suffix in DOWNLOAD_SUFFIXES:
            with contextlib.suppress(FileNotFoundError):
                (self.downloads / (name + suffix)).unlink()

    def record_event(self, outcome: str, reason: str, **fields: Any) -> None:
        """A history entry that is not an install (rollback, recovery)."""
        journal = self.journal()
        journal["history"].append({"state": outcome, "reason": reason, "finished_at": time.time(), **fields})
        self.write_journal(journal)

    # -- versions ---------------------------------------------------------------------------------
    def _link(self, link: Path) -> Version | None:
        if not link.is_symlink():
            return None
        target = self.root / os.readlink(link)
        parsed = _parse_dirname(target.name)
        if parsed is None or not target.is_dir():
            return None
        return Version(parsed[0], parsed[1], target)

    def active(self) -> Version | None:
        return self._link(self.current_link)

    def previous(self) -> Version | None:
        return self._link(self.previous_link)

    def kept(self) -> list[Version]:
        versions = []
        if self.bundles.is_dir():
            for folder in sorted(self.bundles.iterdir()):
                parsed = _parse_dirname(folder.name)
                if parsed is not None and folder.is_dir():
                    versions.append(Version(parsed[0], parsed[1], folder))
        return sorted(versions, key=lambda v: (v.name, v.version))

    def bundle_dir(self, name: str, version: int) -> Path:
        return self.bundles / f"{name}-v{version}"

    def point(self, link: Path, version: Version | None) -> None:
        """Switch a link in one rename (or remove it)."""
        if version is None:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            fsync_dir(link.parent)
            return
        replace_symlink(link, os.path.relpath(version.path, self.root))

    def new_staging(self, install_id: str) -> Path:
        path = self.staging / install_id
        shutil.rmtree(path, ignore_errors=True)  # a fresh folder every time
        return path

    def promote(self, staging: Path, name: str, version: int) -> Version:
        """Rename a verified staging folder into bundles/ (same file system: atomic), its modes set first:
        folders 0755, files 0644, whatever the umask (never writable but by the service user)."""
        seal_tree(staging)
        target = self.bundle_dir(name, version)
        if target.exists():
            current = self.active()
            if current is not None and current.path == target:
                raise StoreError(f"{name} v{version} is the active bundle")
            shutil.rmtree(target)
        os.replace(staging, target)
        fsync_dir(self.bundles)
        return Version(name, version, target)

    def gc(self, *, keep_resumable: bool = True) -> list[str]:
        """Remove every bundle but the active and previous one, stale staging folders and every download but
        the running install's (and, unless told otherwise, the one a restart cut off)."""
        keep = {v.path for v in (self.active(), self.previous()) if v is not None}
        removed: list[str] = []
        for version in self.kept():
            if version.path not in keep:
                shutil.rmtree(version.path, ignore_errors=True)
                removed.append(version.label)
        journal = self.journal()
        running = (journal["install"] or {}).get("id")
        if self.staging.is_dir():
            for folder in self.staging.iterdir():
                if folder.name != running:
                    shutil.rmtree(folder, ignore_errors=True)
        in_progress = (journal["install"] or {}).get("download")
        resumable = (journal.get("resumable") or {}).get("download") if keep_resumable else None
        removed += self.clear_downloads({str(name) for name in (in_progress, resumable) if name})
        return removed

    def drop_bytecode(self) -> list[str]:
        """Remove the `__pycache__` folders of kept bundles that their manifest does not list: an earlier
        release's Python workers wrote them beside a model's code (a .pyc there would run instead of the
        signed source, and the bundle would no longer match its manifest). Called at start, before any
        model loads; returns the folders removed."""
        removed: list[str] = []
        for version in self.kept():
            try:
                listed = bundle_files.read_signed(version.path).files
            except bundle_files.BundleDamaged:
                continue  # its models fail to load, naming the manifest
            for folder, dirs, _ in os.walk(version.path / "models"):
                for name in [d for d in dirs if d == "__pycache__"]:
                    path = Path(folder, name)
                    relative = path.relative_to(version.path).as_posix()
                    if not path.is_symlink() and not any(f.startswith(relative + "/") for f in listed):
                        shutil.rmtree(path, ignore_errors=True)  # one left behind fails its model's load
                        dirs.remove(name)
                        if not path.exists():
                            removed.append(f"{version.path.name}/{relative}")
        return removed

    def clear_downloads(self, keep: set[str]) -> list[str]:
        """Everything in downloads/ that is not (a part of) a download named in `keep`."""
        removed: list[str] = []
        if not self.downloads.is_dir():
            return removed
        for entry in sorted(self.downloads.iterdir()):
            if download_of(entry.name) in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
            removed.append(f"downloads/{entry.name}")
        return removed

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One installer at a time per store, across processes (the appliance, the CLI)."""
        self.ensure()
        fd = os.open(self.root / "install.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreError("another install or rollback is running on this store") from None
            yield
        finally:
            os.close(fd)

    def status(self) -> dict[str, Any]:
        journal = self.journal()
        active, previous = self.active(), self.previous()
        install = journal["install"]
        return {
            "active": active.label if active else None,
            "active_name": active.name if active else None,
            "active_version": active.version if active else None,
            "previous_version": previous.version if previous else None,
            "state": install["state"] if install else "IDLE",
            "install": install,
            "kept_versions": [v.version for v in self.kept()],
            "installed": journal["installed"],
            "security_floor": self.security_floor(),
            "history": journal["history"],
        }
