"""The install state machine: DOWNLOADING -> VERIFYING -> STAGED -> LOADING -> TRIAL -> COMMITTED, or
ROLLING_BACK -> FAILED / ROLLED_BACK. Every transition is journaled (fsync) before it happens.

Nothing a bundle does can touch what serves until the trial passed: the new version is unpacked into
a fresh folder, loaded and checked beside the old one (the `Activator` decides how), and only then does
one rename of the `current` link switch the device over.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from edgeserve.fsutil import write_text_atomic
from edgeserve.logs import safe
from edgeserve.ota import archive
from edgeserve.ota.errors import BundleRefused, StoreError
from edgeserve.ota.fetch import download_name, fetch
from edgeserve.ota.manifest import Manifest, parse_manifest
from edgeserve.ota.policy import Policy, check_disk, check_manifest
from edgeserve.ota.store import (
    COMMITTED,
    DOWNLOADING,
    FAILED,
    LOADING,
    ROLLED_BACK,
    ROLLING_BACK,
    STAGED,
    TRIAL,
    VERIFYING,
    Store,
    Version,
)  # fmt: skip
from edgeserve.ota.url_policy import UrlPolicy
from edgeserve.repository import bundle_files

log = logging.getLogger("edgeserve.ota")

Report = Callable[[str, float | None, str], None]  # (state, progress 0..1 or None, message)
# Who asked: the operator on the device (any file or URL) or the fleet (URLs under the URL policy).
Origin = Literal["operator", "fleet"]


def hold_point(store: Store, point: str) -> None:
    """Test hook for the kill-at-every-step harness: with EDGESERVE_TEST_OTA_HOLD=<point>, stop here (after
    the journal write) until killed; `<ota>/held` says where. Unset on devices: costs one lookup."""
    if os.environ.get("EDGESERVE_TEST_OTA_HOLD") == point:
        write_text_atomic(store.root / "held", point)  # the harness reads it the moment it exists
        time.sleep(120)


class TrialFailed(Exception):
    """The new version did not load, failed a check or fell over during the trial window."""


class Activator(Protocol):
    """How a verified bundle is tried and put into service (a running appliance, or none)."""

    def trial(self, models_dir: Path, manifest: Manifest, report: Report) -> None: ...

    def switch(self, old: Version | None, new: Version | None, report: Report) -> None: ...


@dataclass
class Outcome:
    ok: bool
    state: str  # COMMITTED | FAILED | ROLLED_BACK
    reason: str
    name: str = ""
    version: int = 0
    code: str = ""  # a refusal's reason code ("replay", "signature", ...), "" otherwise

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "state": self.state, "reason": self.reason, "name": self.name,
                "version": self.version, "code": self.code}  # fmt: skip


class Installer:
    def __init__(
        self,
        store: Store,
        activator: Activator,
        *,
        policy: Policy | None = None,
        arch: str | None = None,
        accelerators: set[str] | None = None,
        other_models: Callable[[], set[str]] = set,
        url_policy: UrlPolicy | None = None,
    ) -> None:
        self.store = store
        self.activator = activator
        self.policy = policy or Policy()
        self.url_policy = url_policy or UrlPolicy()  # for fleet-initiated installs only
        self.arch = arch or platform.machine()
        self.accelerators = accelerators or set()
        self.other_models = other_models  # model names served from --model-repository

    # -- install ----------------------------------------------------------------------------------
    def install(self, source: str, report: Report, *, sha256: str | None = None,
                cancel: threading.Event | None = None, origin: Origin = "operator") -> Outcome:  # fmt: skip
        with self.store.lock():
            self.store.ensure()
            name = download_name(source)
            record = self.store.begin(source, origin=origin, **({"download": name} if name else {}))
            url_policy = self.url_policy if origin == "fleet" else None
            try:
                bundle = fetch(self.store, source, report, sha256=sha256, cancel=cancel, policy=self.policy,
                               url_policy=url_policy)  # fmt: skip
                return self._install(record["id"], bundle, report, cancel)
            except BundleRefused as exc:
                return self._fail(FAILED, f"refused: {exc}", report, code=exc.reason)
            except TrialFailed as exc:
                return self._fail(FAILED, f"trial failed: {exc}", report)
            except StoreError as exc:
                return self._fail(FAILED, str(exc), report)
            except Exception as exc:  # the device must end in a known state whatever broke
                log.exception("install of %s failed unexpectedly", safe(source))
                return self._fail(FAILED, f"internal error: {type(exc).__name__}: {exc}", report)

    def _install(
        self, install_id: str, bundle: Path, report: Report, cancel: threading.Event | None
    ) -> Outcome:
        hold_point(self.store, DOWNLOADING)
        self.store.transition(VERIFYING)
        report(VERIFYING, None, "checking the signature and the manifest")
        body, signature = archive.read_header(bundle)
        try:
            declared = str(json.loads(body).get("key_id", ""))
        except (ValueError, AttributeError):
            declared = ""
        self.store.trust.verify_bundle(body, signature, declared)
        manifest = parse_manifest(body)
        self.store.transition(VERIFYING, name=manifest.name, version=manifest.version)
        check_manifest(manifest, installed_versions=self.store.journal()["installed"], policy=self.policy,
                       security_floor=self.store.security_floor(), arch=self.arch,
                       accelerators=self.accelerators)  # fmt: skip
        clash = set(manifest.models) & self.other_models()
        if clash:
            raise BundleRefused(
                "conflict", f"model(s) {', '.join(sorted(clash))} are also in the model repository"
            )
        kept = sum(self._size(v.path) for v in (self.store.active(),) if v is not None)
        check_disk(self.store.root, manifest.unpacked_size + kept // 4, self.policy, "unpacking the bundle")
        staging = self.store.new_staging(install_id)
        try:

            def unpacking(done: int, total: int) -> None:
                report(VERIFYING, done / max(total, 1), "unpacking")
                if done * 2 >= total:
                    hold_point(self.store, "EXTRACTING")

            archive.extract(bundle, manifest, staging / "unpack", unpacking)
            (staging / "unpack" / "manifest.json").write_bytes(body)
            (staging / "unpack" / "manifest.sig").write_bytes(signature)  # kept: what the manifest is
            new = self.store.promote(staging / "unpack", manifest.name, manifest.version)
        finally:
            archive_cleanup(staging)
        # Just hashed as they were written: the check before the switch reads only their stat.
        bundle_files.remember(new.path, {f.path: f.sha256 for f in manifest.files})
        self.store.transition(STAGED, path=str(new.path))
        report(STAGED, None, f"{new.label} verified and staged")
        hold_point(self.store, STAGED)
        if cancel is not None and cancel.is_set():
            self._discard(new)
            return self._fail(FAILED, "cancelled", report)
        self.store.transition(LOADING)
        hold_point(self.store, LOADING)
        try:
            self.activator.trial(new.path / "models", manifest, report)
        except TrialFailed:
            self._discard(new)
            raise
        damaged = damage(new)  # nothing in it changed since it was unpacked
        if damaged is not None:
            self._discard(new)
            raise TrialFailed(damaged)
        old, old_previous = self.store.active(), self.store.previous()
        self.store.transition(TRIAL, switching=True, old=str(old.path) if old else None,
                              old_previous=str(old_previous.path) if old_previous else None)  # fmt: skip
        hold_point(self.store, TRIAL)
        self.store.point(self.store.current_link, new)
        hold_point(self.store, "SWITCHED")
        try:
            self.activator.switch(old, new, report)
        except TrialFailed as exc:
            self._roll_back(old, new, report)
            return self._fail(ROLLED_BACK, f"after the switch: {exc}", report)
        self.store.point(self.store.previous_link, old)
        hold_point(self.store, "ACTIVATED")
        label = f"{new.label} serves"
        record = self.store.finish(COMMITTED, label, installed=(manifest.name, manifest.version),
                                   security_version=manifest.security_version)  # fmt: skip
        report(COMMITTED, 1.0, label + (f" (previous: {old.label})" if old else ""))
        removed = self.store.gc()  # the download too: it is no install's any more
        if removed:
            log.info("gc removed: %s", ", ".join(removed))
        log.info("install %s committed: %s", record.get("id"), new.label)
        return Outcome(True, COMMITTED, f"{new.label} serves", manifest.name, manifest.version)

    @staticmethod
    def _size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    def _discard(self, version: Version) -> None:
        active = self.store.active()
        if active is None or active.path != version.path:
            import shutil

            shutil.rmtree(version.path, ignore_errors=True)

    def _roll_back(self, old: Version | None, new: Version, report: Report) -> None:
        self.store.transition(ROLLING_BACK)
        report(ROLLING_BACK, None, f"back to {old.label if old else 'no bundle'}")
        self.store.point(self.store.current_link, old)
        try:
            self.activator.switch(new, old, report)
        except TrialFailed as exc:  # the old version is on disk, whole: the next start serves it
            log.error("rollback: the server did not take %s back at once: %s", old.label if old else "-", exc)
        self._discard(new)

    def _fail(self, state: str, reason: str, report: Report, code: str = "") -> Outcome:
        journal = self.store.journal()
        record = journal["install"] or {}
        staged = record.get("path")
        if staged and state == FAILED:
            active = self.store.active()
            if active is None or str(active.path) != staged:
                import shutil

                shutil.rmtree(staged, ignore_errors=True)
        if record.get("download"):  # a refused or failed download never stays behind
            self.store.remove_download(str(record["download"]))
        if record:
            self.store.finish(state, reason)
        self.store.gc()
        report(state, None, reason)
        log.warning("install %s: %s", state, safe(reason, 400))  # it may quote a URL from the fleet
        return Outcome(
            False, state, reason, str(record.get("name", "")), int(record.get("version", 0) or 0), code
        )

    # -- rollback and recovery -------------------------------------------------------------------
    def rollback(self, to_version: int, report: Report) -> Outcome:
        with self.store.lock():
            active = self.store.active()
            target = next((v for v in self.store.kept() if v.version == to_version
                           and (active is None or v.name == active.name)), None)  # fmt: skip
            if target is None:
                kept = ", ".join(str(v.version) for v in self.store.kept()) or "none"
                raise StoreError(f"version {to_version} is not kept on this device (kept: {kept})")
            if active is not None and active.path == target.path:
                return Outcome(True, COMMITTED, f"{target.label} already serves", target.name, target.version)
            revoked = self.store.trust.revoked_signer(target.path)
            if revoked is not None:
                raise StoreError(f"{target.label} is signed by revoked key {revoked}: not rolled back to it")
            damaged = damage(target)
            if damaged is not None:
                raise StoreError(f"{damaged}: not rolled back to it")
            report(ROLLING_BACK, None, f"{active.label if active else '-'} -> {target.label}")
            self.store.point(self.store.current_link, target)
            try:
                self.activator.switch(active, target, report)
            except TrialFailed as exc:
                self.store.point(self.store.current_link, active)
                with_error = (
                    f"rollback to {target.label} failed, {active.label if active else '-'} kept: {exc}"
                )
                self.store.record_event(FAILED, with_error)
                return Outcome(False, FAILED, with_error, target.name, target.version)
            self.store.point(self.store.previous_link, active)
            self.store.record_event(ROLLED_BACK, f"rolled back to {target.label}", name=target.name,
                                    version=target.version)  # fmt: skip
            report(ROLLED_BACK, 1.0, f"{target.label} serves")
            return Outcome(True, ROLLED_BACK, f"{target.label} serves", target.name, target.version)


def damage(version: Version) -> str | None:
    """Why a kept bundle may not be switched to (a file differs from its signed manifest), or None."""
    try:
        damaged = bundle_files.problems(version.path)
    except bundle_files.BundleDamaged as exc:
        damaged = [str(exc)]
    return f"{version.label} does not match its signed manifest: {damaged[0]}" if damaged else None


def archive_cleanup(staging: Path) -> None:
    import shutil

    shutil.rmtree(staging, ignore_errors=True)


def recover(store: Store) -> str | None:
    """After a crash or power cut: undo the install the journal says was under way. Returns what was
    done (for the log and the history), None when nothing was pending."""
    journal = store.journal()
    record = journal["install"]
    if record is None:
        return None
    state = record.get("state", "?")
    label = f"{record.get('name', '?')} v{record.get('version', '?')}"
    old = record.get("old")
    if record.get("switching"):
        for link, path in ((store.current_link, old), (store.previous_link, record.get("old_previous"))):
            store.point(link, Version(label, 0, Path(path)) if path else None)
    staged = record.get("path")
    active = store.active()
    if staged and (active is None or str(active.path) != staged):
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
    serving = active.label if active else "no bundle"
    reason = f"interrupted in {state} (restart or power loss): undone, {serving} serves"
    outcome = ROLLED_BACK if record.get("switching") else FAILED
    store.finish(outcome, reason)
    download = record.get("download")
    if download and state == DOWNLOADING:  # cut off mid-transfer: the next install of that URL resumes it
        store.mark_resumable(str(download), str(record.get("source", "")))
    elif download:
        store.remove_download(str(download))
    store.gc()
    log.warning("install %s of %s %s", record.get("id"), label, reason)
    return f"{label}: {reason}"
