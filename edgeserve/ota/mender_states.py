"""The edgeserve-bundle Update Module's states (the Mender protocol v3 side is mender_module.py), written so
that each one can be run again after any of them was killed, and so that what serves agrees with what
Mender records.

Mender (standalone `mender install`) records a deployment only once ArtifactInstall returned, and changes
the artifact name it reports only after Cleanup; until then it names what served before. So:

- ArtifactRollback / ArtifactFailure: whatever ran before, put back what served before this deployment
  (Mender names that artifact once they succeed); nothing to do if this deployment installed nothing.
- ArtifactCommit / ArtifactVerifyReboot: this deployment's bundle must serve, or the state fails (and
  Mender rolls back).
- ArtifactInstall: first settles the deployment before it. If Mender never recorded it (its `mender
  install` was killed, or another install ran over it uncommitted), Mender still names what served
  before it, so that bundle is put back before anything else happens; then the new bundle is installed
  over it, which keeps it as the rollback target.
- A `mender` that dies while ArtifactInstall or NeedsArtifactReboot runs never records the deployment:
  the module, which outlives it (Mender starts it in its own process group), undoes it.

The notes (`<state_dir>/mender/deployment.json`) say, for the latest deployment: its id (a marker the
module leaves in Mender's file tree for it), its artifact, what Mender named before it, the bundle that
served before it and the one it installs. They are kept after Cleanup: the next deployment settles
against them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from edgeserve.fsutil import write_json_atomic

MODULE_TYPE = "edgeserve-bundle"
Label = dict[str, Any]  # {"name": ..., "version": ...}


class ModuleError(Exception):
    """This state failed: one line on stderr, exit 1 (Mender then runs its failure states)."""


class Device(Protocol):
    """The appliance's installer (mender_module.Device)."""

    def install(self, source: Path) -> dict[str, Any]: ...

    def rollback(self, version: int) -> dict[str, Any]: ...

    def active(self) -> Label | None: ...

    def kept(self, label: Label) -> bool: ...


def report(state: str, progress: float | None, message: str) -> None:
    percent = f" {progress * 100:5.1f}%" if progress is not None else ""
    with contextlib.suppress(OSError):  # Mender went away: the state goes on to a known end all the same
        print(f"{MODULE_TYPE}: {state}{percent} {message}", file=sys.stderr, flush=True)


def shown(label: Label | None) -> str:
    return f"{label['name']} v{label['version']}" if label else "no bundle"


def bundle_label(bundle: Path) -> Label | None:
    """The name and version the bundle's manifest claims (not verified: only to recognise it later)."""
    from edgeserve.ota.archive import read_header
    from edgeserve.ota.manifest import parse_manifest

    try:
        manifest = parse_manifest(read_header(bundle)[0])
    except Exception:  # a bundle that does not parse is refused by the install itself
        return None
    return {"name": manifest.name, "version": manifest.version}


class Module:
    def __init__(self, state_dir: Path, device: Device, *, deployment: str = "", artifact: str = "",
                 record: str = "", busy_wait_s: float = 600.0) -> None:  # fmt: skip
        self.state_dir = state_dir
        self.device = device
        self.deployment = deployment  # this deployment's id (the marker in Mender's tree for it)
        self.artifact = artifact  # the artifact's name
        self.record = record  # the artifact Mender names for the device as this deployment began
        self.busy_wait_s = busy_wait_s
        self.folder = state_dir / "mender"
        self.notes = self.folder / "deployment.json"

    # -- the notes --------------------------------------------------------------------------------
    def read_notes(self) -> dict[str, Any] | None:
        import json

        try:
            data = json.loads(self.notes.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_notes(self, notes: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.notes, notes)

    def ours(self) -> dict[str, Any] | None:
        """The notes, if they are this deployment's (else its ArtifactInstall never began)."""
        notes = self.read_notes()
        return notes if notes is not None and self.deployment and notes.get("id") == self.deployment else None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One state at a time per state folder: a module that outlived its `mender` finishes (and undoes)
        before the next deployment's states look at the device."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / "module.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.busy_wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ModuleError("another edgeserve-bundle state is still running") from None
                    time.sleep(0.2)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- putting a bundle back --------------------------------------------------------------------
    def put_back(self, target: Label) -> None:
        """Make `target` (a kept bundle) serve."""
        result = self.device.rollback(int(target["version"]))
        if not result.get("ok"):
            why = result.get("reason") or result.get("error")
            raise ModuleError(f"rollback to {shown(target)} failed: {why}")
        report("ROLLED_BACK", 1.0, str(result.get("reason", "")))

    def undo(self, notes: dict[str, Any], why: str) -> Label | None:
        """Put back what served before the deployment in `notes`, if its bundle still serves; returns what
        serves after. Nothing is done when something else serves (undone already, or changed by hand)."""
        active, before = self.device.active(), notes.get("before")
        before = before if isinstance(before, dict) else None
        theirs: Label | None = notes.get("installed") or notes.get("installing")
        if active is None or active != theirs or before is None or before == active:
            return active
        if not self.device.kept(before):
            report("SETTLE", None, f"{shown(before)} is no longer kept: {shown(active)} stays")
            return active
        report("SETTLE", None, f"{why}: back to {shown(before)} first")
        self.put_back(before)
        return before

    # -- states -----------------------------------------------------------------------------------
    def artifact_install(self, bundle: Path) -> int:
        before = self.settle()
        notes = {"id": self.deployment, "artifact": self.artifact, "record": self.record, "before": before,
                 "installing": bundle_label(bundle), "installed": None, "at": time.time()}  # fmt: skip
        self.write_notes(notes)
        try:
            result = self.device.install(bundle)
        finally:  # unpacked into the store, or refused: the copy is no use any more (Cleanup may never come)
            self.cleanup()
        label: Label = {"name": result.get("name"), "version": result.get("version")}
        if not result.get("ok") and result.get("code") == "replay":
            if self.device.active() == label:
                result = {**result, "ok": True, "reason": f"{shown(label)} already serves"}
            elif self.device.kept(label):  # verified when it was first installed: switch back to it
                result = self.device.rollback(int(label["version"] or 0))
        if not result.get("ok"):
            raise ModuleError(str(result.get("reason") or result.get("error") or "install failed"))
        self.write_notes({**notes, "installed": label})
        report("INSTALLED", 1.0, str(result.get("reason", "")))
        return 0

    def settle(self) -> Label | None:
        """What serves as Mender's record has it, before this deployment installs anything: an earlier
        deployment Mender never recorded (Mender still names what served before it) is undone first."""
        notes = self.read_notes()
        if notes is None or (self.record and self.record == notes.get("artifact")):
            return self.device.active()  # none, or Mender recorded it: what serves is what Mender names
        return self.undo(notes, f"{notes.get('artifact')} was never recorded by Mender")

    def abandoned(self) -> int:
        """The `mender` running this deployment died before recording it: it never will, so undo it."""
        notes = self.ours()
        if notes is not None:
            self.undo(notes, "Mender went away before recording this deployment")
        return 1

    def verify(self, commit: bool) -> int:
        notes = self.ours()
        if notes is None:
            raise ModuleError("this deployment's install never ran on this device: nothing to commit")
        installed, active = notes.get("installed"), self.device.active()
        if installed is None:
            raise ModuleError("this deployment installed nothing (its install failed or was interrupted)")
        if active != installed:
            raise ModuleError(f"{shown(installed)} no longer serves ({shown(active)} does): the appliance "
                              "rolled it back")  # fmt: skip
        if commit:
            report("COMMIT", None, f"{shown(installed)} serves")
        return 0

    def roll_back(self, strict: bool) -> int:
        notes = self.ours()
        if notes is None:
            return 0  # this deployment's install never began: nothing of it to undo
        before, active = notes.get("before"), self.device.active()
        if active == before:
            return 0
        if before is None:
            if not strict:
                return 0
            raise ModuleError("no bundle served before this deployment: nothing to roll back to")
        self.put_back(before)
        return 0

    def cleanup(self) -> int:
        """The handed-over bundle goes (if a killed install left it); the notes stay, for the next
        deployment to settle against."""
        shutil.rmtree(self.folder / "incoming", ignore_errors=True)
        return 0

    def receive(self, payload: BinaryIO) -> Path:
        """The bundle, copied from Mender's tree (root's, 0700) to where the appliance's user reads it, and
        written as that user: nothing in its folder (a link, say) can make root write elsewhere. The bundle's
        own signature is what the installer checks, not where this copy came from."""
        incoming = self.folder / "incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        target = incoming / "bundle.esb"
        target.unlink(missing_ok=True)
        with open(target, "xb") as out:
            shutil.copyfileobj(payload, out, 1 << 20)
        return target
