"""The Mender Update Module for edgeserve bundles (protocol v3, payload type `edgeserve-bundle`), installed as
/usr/share/mender/modules/v3/edgeserve-bundle by ota/mender/install.sh. Mender calls it with a state name
and its file tree; the artifact's one payload file is the signed `.esb` itself.

Mender's states onto the installer's (what each does, and why each can run again after any of them was
killed, is in mender_states.py):

    Download              nothing: Mender stores the payload in files/ (it verifies its checksums first)
    ArtifactInstall       an earlier deployment Mender never recorded is undone first; then install:
                          signature, manifest, staged, trial, switch (the running appliance's installer over
                          its control socket, or the store itself when none runs); what served before is
                          written down for a rollback
    NeedsArtifactReboot   No (and, if the `mender` that asked died meanwhile, the install is undone)
    ArtifactVerifyReboot  the bundle still serves
    ArtifactCommit        the same check
    ArtifactRollback      back to what served before (a kept, verified bundle): the installer's rollback
    ArtifactFailure       the same, if still needed
    Cleanup               the handed-over bundle is removed

Settings: a TOML file, `$EDGESERVE_MENDER_CONF` or /etc/edgeserve/mender.toml (optional):
`state_dir` (the appliance's state folder; default: as `edgeserve run` resolves it), `config` (the
appliance's settings file), `busy_wait_s` (how long to wait for another install or rollback, 600).
Run as root by Mender, the module works as the state folder's owner (the appliance's user).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from edgeserve.fsutil import write_text_atomic
from edgeserve.ota.mender_states import MODULE_TYPE, Label, Module, ModuleError, report

__all__ = ["Device", "Module", "ModuleConfig", "ModuleError", "become_owner", "load_module_config", "main"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONF = Path("/etc/edgeserve/mender.toml")
BUSY = ("another install", "busy")


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
    parent = os.getppid()  # the `mender` that runs this state: Mender starts modules in their own group
    _test_hold(state)
    code = _run(state, args)
    _test_hold(f"{state}:done")
    if state in ("ArtifactInstall", "NeedsArtifactReboot") and os.getppid() != parent:
        # That `mender` died before it recorded this deployment (it records it once NeedsArtifactReboot has
        # answered), and nothing will ever roll it back: undo it here.
        _run("Abandoned", args)
        code = 1
    return code


def _run(state: str, args: list[str]) -> int:
    if state == "SupportsRollback":
        return _answer("Yes")
    if state == "NeedsArtifactReboot":
        return _answer("No")  # a bundle switch needs no reboot
    handlers: dict[str, Callable[[Module], int]] = {
        "ArtifactVerifyReboot": lambda m: m.verify(commit=False),
        "ArtifactCommit": lambda m: m.verify(commit=True),
        "ArtifactRollback": lambda m: m.roll_back(strict=True),
        "ArtifactFailure": lambda m: m.roll_back(strict=False),
        "Cleanup": Module.cleanup,
        "Abandoned": Module.abandoned,  # not Mender's: main() after a `mender` died (see there)
    }
    if state != "ArtifactInstall" and state not in handlers:
        return 0  # Download, and states this protocol may add later: nothing to do
    tree = Path(args[1]) if len(args) > 1 else Path.cwd()
    try:
        conf = load_module_config()
        if not conf.state_dir.is_dir():
            raise ModuleError(f"state folder {conf.state_dir} does not exist (state_dir in "
                              f"{os.environ.get('EDGESERVE_MENDER_CONF') or DEFAULT_CONF})")  # fmt: skip
        # Mender's tree is root's: read it before becoming the owner
        deployment = deployment_id(tree, create=state == "ArtifactInstall")
        record = _read(tree / "current_artifact_name")
        artifact = _read(tree / "header" / "artifact_name")
        payload = open_payload(tree) if state == "ArtifactInstall" else None
        become_owner(conf.state_dir)
        module = Module(conf.state_dir, Device(conf), deployment=deployment, artifact=artifact,
                        record=record, busy_wait_s=conf.busy_wait_s)  # fmt: skip
        with module.lock():
            if payload is None:
                return handlers[state](module)
            with payload:
                bundle = module.receive(payload)
            return module.artifact_install(bundle)
    except ModuleError as exc:
        print(f"{MODULE_TYPE} {state}: {exc}", file=sys.stderr)
        return 1


def _answer(word: str) -> int:
    with contextlib.suppress(OSError):  # a `mender` that died no longer reads it
        print(word, flush=True)
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def deployment_id(tree: Path, create: bool) -> str:
    """This deployment's id: a marker the module leaves in the tree Mender makes for each deployment (and
    keeps, through a restart, until Cleanup). "" before ArtifactInstall made it."""
    marker = tree / "tmp" / "edgeserve-deployment"
    found = _read(marker)
    if found or not create:
        return found
    made = uuid.uuid4().hex[:16]
    write_text_atomic(marker, made + "\n")  # fsync'd: Mender's daemon resumes on this tree after a power cut
    return made


HOLD_ENV = "EDGESERVE_TEST_MENDER_HOLD"


def _test_hold(point: str) -> None:
    """Test hook for the kill-in-every-state tests: with EDGESERVE_TEST_MENDER_HOLD=<point> (`<State>` on
    entry, `<State>:done` once its work is done), write `<state_dir>/mender/held` (the point and this pid)
    and wait until the test removes it, killing Mender meanwhile. Unset on devices: costs one lookup."""
    if os.environ.get(HOLD_ENV) != point:
        return
    with contextlib.suppress(ModuleError, OSError):
        marker = load_module_config().state_dir / "mender" / "held"
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, f"{point} {os.getpid()}")  # the harness reads it the moment it exists
        deadline = time.monotonic() + 300  # a test that died leaves no module behind for long
        while marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
