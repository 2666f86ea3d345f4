"""The Mender Update Module for edgeserve bundles (protocol v3, payload type `edgeserve-bundle`), installed as
/usr/share/mender/modules/v3/edgeserve-bundle by ota/mender/install.sh. Mender calls it with a state name
and its file tree; the artifact's one payload file is the signed `.esb` itself.

Mender's states onto the installer's:

    Download              nothing: Mender stores the payload in files/ (it verifies its checksums first)
    ArtifactInstall       install: signature, manifest, staged, trial, switch (the running appliance's
                          installer over its control socket, or the store itself when none runs); what served
                          before is written down for a rollback
    ArtifactVerifyReboot  the bundle still serves (no reboot is needed: NeedsArtifactReboot = No)
    ArtifactCommit        the same check, then the deployment is done
    ArtifactRollback      back to what served before (a kept, verified bundle): the installer's rollback
    ArtifactFailure       the same, if still needed
    Cleanup               the module's notes for this deployment are removed

Settings: a TOML file, `$EDGESERVE_MENDER_CONF` or /etc/edgeserve/mender.toml (optional):
`state_dir` (the appliance's state folder; default: as `edgeserve run` resolves it), `config` (the
appliance's settings file), `busy_wait_s` (how long to wait for another install or rollback, 600).
Run as root by Mender, the module works as the state folder's owner (the appliance's user).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from edgeserve.fsutil import write_json_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODULE_TYPE = "edgeserve-bundle"
DEFAULT_CONF = Path("/etc/edgeserve/mender.toml")
BUSY = ("another install", "busy")


class ModuleError(Exception):
    """This state failed: one line on stderr, exit 1 (Mender then runs its failure states)."""


@dataclass(frozen=True)
class ModuleConfig:
    state_dir: Path
    config: Path | None
    busy_wait_s: float = 600.0


def load_module_config(environ: dict[str, str] | None = None) -> ModuleConfig:
    env = dict(os.environ) if environ is None else environ
    path = Path(env.get("EDGESERVE_MENDER_CONF") or DEFAULT_CONF)
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModuleError(f"{path}: not a readable TOML file: {exc}") from None
    unknown = set(data) - {"state_dir", "config", "busy_wait_s"}
    if unknown:
        raise ModuleError(f"{path}: unknown setting(s) {', '.join(sorted(unknown))}; known: state_dir, "
                          "config, busy_wait_s")  # fmt: skip
    for key in ("state_dir", "config"):
        if key in data and not isinstance(data[key], str):
            raise ModuleError(f"{path}: {key} must be a path (a string)")
    wait = data.get("busy_wait_s", 600.0)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or wait < 0:
        raise ModuleError(f"{path}: busy_wait_s must be a number of seconds >= 0")
    config = Path(data["config"]) if "config" in data else None
    if "state_dir" in data:
        state_dir = Path(data["state_dir"])
    else:
        from edgeserve.settings_tools import load_layered, resolve_state_dir

        settings, sources = load_layered(config)
        state_dir = resolve_state_dir(settings, sources)[0]
    return ModuleConfig(state_dir.resolve(), config, float(wait))


def report(state: str, progress: float | None, message: str) -> None:
    percent = f" {progress * 100:5.1f}%" if progress is not None else ""
    with contextlib.suppress(OSError):  # Mender went away: the install goes on to a known end all the same
        print(f"{MODULE_TYPE}: {state}{percent} {message}", file=sys.stderr, flush=True)


Label = dict[str, Any]  # {"name": ..., "version": ...}


class Device:
    """The appliance's installer: over the control socket when it runs, else on the store directly."""

    def __init__(self, conf: ModuleConfig) -> None:
        self.conf = conf
        self.state_dir = conf.state_dir

    def install(self, source: Path) -> dict[str, Any]:
        return self._request({"op": "install", "source": str(source)})

    def rollback(self, version: int) -> dict[str, Any]:
        return self._request({"op": "rollback", "to": version})

    def active(self) -> Label | None:
        status = self._request({"op": "status"}).get("status") or {}
        if status.get("active_name") is None:
            return None
        return {"name": status["active_name"], "version": status["active_version"]}

    def kept(self, label: Label) -> bool:
        from edgeserve.ota.store import Store

        return any(
            (v.name, v.version) == (label["name"], label["version"]) for v in Store(self.state_dir).kept()
        )

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        from edgeserve.supervisor.ota_service import call

        deadline = time.monotonic() + self.conf.busy_wait_s
        while True:
            events = lambda e: report(e.get("state", ""), e.get("progress"), e.get("message", ""))  # noqa: E731
            result = call(self.state_dir, request, events)
            if result is None:  # no appliance serves this state folder
                result = self._offline(request)
            text = str(result.get("error") or result.get("reason") or "")
            if result.get("ok") or not any(b in text for b in BUSY) or time.monotonic() > deadline:
                return result
            time.sleep(1.0)

    def _offline(self, request: dict[str, Any]) -> dict[str, Any]:
        from edgeserve.ota.cli import _offline_installer
        from edgeserve.ota.errors import StoreError
        from edgeserve.ota.installer import recover

        installer = _offline_installer(argparse.Namespace(config=self.conf.config, state_dir=self.state_dir))
        try:
            with installer.store.lock():
                recover(installer.store)  # an install a crash or power cut interrupted is undone first
            if request["op"] == "status":
                return {"ok": True, "status": installer.store.status()}
            if request["op"] == "install":
                outcome = installer.install(request["source"], report)
            else:
                outcome = installer.rollback(int(request["to"]), report)
        except StoreError as exc:
            return {"ok": False, "error": str(exc)}
        return dict(outcome.to_dict())


class Module:
    def __init__(self, conf: ModuleConfig, artifact: str = "") -> None:
        self.conf = conf
        self.artifact = artifact  # the artifact's name, read from Mender's tree while still root
        self.device = Device(conf)
        self.notes = conf.state_dir / "mender" / "deployment.json"

    # -- the deployment's notes (what served before it, what it installed) -------------------------
    def read_notes(self) -> dict[str, Any] | None:
        import json

        try:
            data = json.loads(self.notes.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_notes(self, notes: dict[str, Any]) -> None:
        self.notes.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.notes, notes)

    # -- states -----------------------------------------------------------------------------------
    def artifact_install(self, bundle: Path) -> int:
        stale = self.read_notes()
        # Mender still believes what served before an interrupted deployment (it never recorded that one).
        before = stale["before"] if stale is not None and not stale.get("committed") else self.device.active()
        notes = {"artifact": self.artifact, "before": before, "installed": None, "at": time.time()}
        self.write_notes(notes)
        result = self.device.install(bundle)
        label: Label = {"name": result.get("name"), "version": result.get("version")}
        if not result.get("ok") and result.get("code") == "replay":
            if self.device.active() == label:
                result = {
                    **result,
                    "ok": True,
                    "reason": f"{label['name']} v{label['version']} already serves",
                }
            elif self.device.kept(label):  # verified when it was first installed: switch back to it
                result = self.device.rollback(int(label["version"] or 0))
        if not result.get("ok"):
            raise ModuleError(str(result.get("reason") or result.get("error") or "install failed"))
        self.write_notes({**notes, "installed": label})
        report("INSTALLED", 1.0, str(result.get("reason", "")))
        return 0

    def verify(self, commit: bool) -> int:
        notes = self.read_notes()
        if notes is None or notes.get("committed"):
            report("COMMIT", None, "no deployment of this module is open: nothing to check")
            return 0
        installed, active = notes.get("installed"), self.device.active()
        if installed is None:
            raise ModuleError("this deployment installed nothing (its install failed or was interrupted)")
        if active != installed:
            now = f"{active['name']} v{active['version']}" if active else "no bundle"
            raise ModuleError(f"{installed['name']} v{installed['version']} no longer serves ({now} does): "
                              "the appliance rolled it back")  # fmt: skip
        if commit:
            self.write_notes({**notes, "committed": True})
        return 0

    def roll_back(self, strict: bool) -> int:
        notes = self.read_notes()
        if notes is None or notes.get("committed"):
            return 0
        before, active = notes.get("before"), self.device.active()
        if active == before:
            return 0
        if before is None:
            if not strict:
                return 0
            raise ModuleError("no bundle served before this deployment: nothing to roll back to")
        result = self.device.rollback(int(before["version"]))
        if not result.get("ok"):
            raise ModuleError(f"rollback to {before['name']} v{before['version']} failed: "
                              f"{result.get('reason') or result.get('error')}")  # fmt: skip
        report("ROLLED_BACK", 1.0, str(result.get("reason", "")))
        return 0

    def cleanup(self) -> int:
        self.notes.unlink(missing_ok=True)
        shutil.rmtree(self.conf.state_dir / "mender" / "incoming", ignore_errors=True)
        return 0

    def receive(self, payload: BinaryIO) -> Path:
        """The bundle, copied from Mender's tree (root's, 0700) to where the appliance's user reads it, and
        written as that user: nothing in its folder (a link, say) can make root write elsewhere. The bundle's
        own signature is what the installer checks, not where this copy came from."""
        incoming = self.conf.state_dir / "mender" / "incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        target = incoming / "bundle.esb"
        target.unlink(missing_ok=True)
        with open(target, "xb") as out:
            shutil.copyfileobj(payload, out, 1 << 20)
        return target


def open_payload(tree: Path) -> BinaryIO:
    """The artifact's one payload file, opened (as root: Mender's tree is root's)."""
    folder = tree / "files"
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    if len(files) != 1:
        raise ModuleError(f"an {MODULE_TYPE} artifact carries exactly one payload file, the .esb bundle; "
                          f"this one has {len(files)}")  # fmt: skip
    return open(files[0], "rb")


def become_owner(state_dir: Path) -> None:
    """Run as the state folder's owner: what the module writes stays the appliance's to manage."""
    if os.geteuid() != 0 or not state_dir.exists():
        return
    owner = state_dir.stat()
    if owner.st_uid == 0:
        return
    import pwd

    try:
        os.initgroups(pwd.getpwuid(owner.st_uid).pw_name, owner.st_gid)
    except KeyError:
        os.setgroups([owner.st_gid])
    os.setgid(owner.st_gid)
    os.setuid(owner.st_uid)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    state = args[0] if args else ""
    if state == "SupportsRollback":
        print("Yes")
        return 0
    if state == "NeedsArtifactReboot":
        print("No")  # a bundle switch needs no reboot
        return 0
    handlers: dict[str, Callable[[Module], int]] = {
        "ArtifactVerifyReboot": lambda m: m.verify(commit=False),
        "ArtifactCommit": lambda m: m.verify(commit=True),
        "ArtifactRollback": lambda m: m.roll_back(strict=True),
        "ArtifactFailure": lambda m: m.roll_back(strict=False),
        "Cleanup": Module.cleanup,
    }
    if state != "ArtifactInstall" and state not in handlers:
        return 0  # Download, and states this protocol may add later: nothing to do
    tree = Path(args[1]) if len(args) > 1 else Path.cwd()
    try:
        conf = load_module_config()
        if not conf.state_dir.is_dir():
            raise ModuleError(f"state folder {conf.state_dir} does not exist (state_dir in "
                              f"{os.environ.get('EDGESERVE_MENDER_CONF') or DEFAULT_CONF})")  # fmt: skip
        if state != "ArtifactInstall":
            become_owner(conf.state_dir)
            return handlers[state](Module(conf))
        payload = open_payload(tree)  # Mender's tree is root's: read it before becoming the owner
        with payload:
            name = tree / "header" / "artifact_name"
            artifact = name.read_text().strip() if name.is_file() else ""
            become_owner(conf.state_dir)
            module = Module(conf, artifact)
            bundle = module.receive(payload)
        return module.artifact_install(bundle)
    except ModuleError as exc:
        print(f"{MODULE_TYPE} {state}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
