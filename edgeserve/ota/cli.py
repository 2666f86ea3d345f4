"""`edgeserve keygen` and `edgeserve bundle build|verify|inspect|install|status|rollback`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_commands(sub: Any, config_flag: Any) -> None:
    keygen = sub.add_parser("keygen", help="make an Ed25519 signing key pair for bundles or fleet commands")
    keygen.add_argument("--out", type=Path, required=True)
    keygen.add_argument("--name", help="file name stem (default: edgeserve, or edgeserve-commands)")
    keygen.add_argument("--role", choices=["bundle", "command"], default="bundle",
                        help="what the key signs: bundles, or fleet commands and desired states; each role "
                             "has its own trusted folder on devices (see ota/keys-policy.md)")  # fmt: skip
    keygen.set_defaults(func=_keygen)

    bundle = sub.add_parser("bundle", help="build, verify, install and roll back signed model bundles")
    actions = bundle.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="build and sign a bundle from a model repository")
    build.add_argument("repo", type=Path)
    build.add_argument("--name", required=True)
    build.add_argument("--version", type=int, required=True)
    build.add_argument("--key", type=Path, required=True)
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--model", action="append", help="only these models (repeatable; default: all)")
    build.add_argument("--arch", action="append", help="compatible CPU architecture (repeatable)")
    build.add_argument("--accelerator", action="append", help="required accelerator, one of (repeatable)")
    build.add_argument("--expires", help="lifetime (30d, 12h) or an RFC 3339 time; default 90d")
    build.add_argument("--checks", type=Path, help="JSON list of checks run during the trial")
    build.add_argument("--calibration", action="append", default=[], metavar="MODEL=DIR",
                       help="INT8 calibration samples (.npy/.npz/images) for MODEL, carried as "
                       "models/MODEL/calibration/ for `edgeserve tune --int8` (repeatable)")  # fmt: skip
    build.add_argument("--no-gzip", action="store_true")
    build.add_argument("--security-version", type=int, default=0,
                       help="0..2^31-1 (default 0): devices that committed a higher one refuse this bundle, "
                       "whatever its name; raise it when a bundle fixes a vulnerability")  # fmt: skip
    build.set_defaults(func=_build)

    verify = actions.add_parser("verify", help="check signature, manifest and every file hash")
    verify.add_argument("file", type=Path)
    verify.add_argument("--trust", type=Path, required=True,
                        help="folder of trusted *.pub keys (or a trust folder: its bundles/)")  # fmt: skip
    verify.set_defaults(func=_verify)

    inspect = actions.add_parser("inspect", help="show a bundle's manifest")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_inspect)

    for action, text in (("install", "install a bundle (through the running appliance when there is one)"),
                         ("status", "the store: active and previous versions, the install history"),
                         ("rollback", "go back to a kept version")):  # fmt: skip
        parser = actions.add_parser(action, help=text)
        if action == "install":
            parser.add_argument("source", help="bundle file or http(s) URL")
            parser.add_argument("--sha256", help="expected sha256 of the bundle file")
        if action == "status":
            parser.add_argument("--json", action="store_true")
        if action == "rollback":
            parser.add_argument("--to", type=int, required=True, dest="to_version")
        parser.add_argument("--state-dir", type=Path)
        config_flag(parser)
        parser.set_defaults(func={"install": _install, "status": _status, "rollback": _rollback}[action])

    from edgeserve.ota.mender_wrap import add_command as add_mender_wrap

    add_mender_wrap(actions)


def _fail(message: str) -> int:
    print(f"edgeserve: {message}", file=sys.stderr)
    return 1


def _keygen(args: argparse.Namespace) -> int:
    from edgeserve.ota.signing import keygen

    name = args.name or ("edgeserve-commands" if args.role == "command" else "edgeserve")
    try:
        private, public, kid = keygen(args.out, name)
    except FileExistsError:
        return _fail(f"{args.out / (name + '.key')} exists; not overwriting a key")
    if args.role == "command":
        private_note = "private: keep it offline; fleet tools sign with it (--key or $EDGESERVE_FLEET_KEY)"
        where = "the [fleet] command_keys folder of every device, default <trust_dir>/commands/"
    else:
        private_note, where = "private, keep it off devices", "<trust_dir>/bundles/ on devices"
    print(f"{private} ({private_note})\n{public} (copy to {where})\nkey_id {kid} (role: {args.role})")
    return 0


def _build(args: argparse.Namespace) -> int:
    from edgeserve.ota.build import BuildRequest, build_bundle
    from edgeserve.ota.errors import BundleRefused

    calibration = {}
    for flag in args.calibration:
        model, sep, folder = flag.partition("=")
        if not sep or not model or not folder:
            return _fail(f"bundle build: --calibration {flag!r}: expected MODEL=DIR")
        calibration[model] = Path(folder)
    request = BuildRequest(args.repo, args.name, args.version, args.key, args.out, models=args.model,
                           arch=args.arch, accelerators=args.accelerator, expires=args.expires,
                           checks=args.checks, compress=not args.no_gzip,
                           security_version=args.security_version, calibration=calibration)  # fmt: skip
    try:
        manifest = build_bundle(request)
    except (OSError, ValueError, BundleRefused) as exc:
        return _fail(f"bundle build: {exc}")
    models = ", ".join(f"{m} {v}" for m, v in manifest["models"].items())
    print(f"{args.out}: {manifest['name']} v{manifest['version']} ({models}; {len(manifest['files'])} files, "
          f"{manifest['unpacked_size']} bytes unpacked, key {manifest['key_id']}, "
          f"security_version {manifest['security_version']}, expires {manifest['expires_at']})")  # fmt: skip
    return 0


def _verify(args: argparse.Namespace) -> int:
    from edgeserve.ota.archive import extract
    from edgeserve.ota.build import verify_bundle
    from edgeserve.ota.errors import BundleRefused

    try:
        manifest, key = verify_bundle(args.file, args.trust)
        with tempfile.TemporaryDirectory(prefix="edgeserve-verify-") as scratch:
            extract(args.file, manifest, Path(scratch) / "x")
    except BundleRefused as exc:
        return _fail(f"{args.file}: refused: {exc}")
    except OSError as exc:
        return _fail(f"{args.file}: {exc}")
    print(f"{args.file}: OK: {manifest.name} v{manifest.version}, signed by {key} ({manifest.key_id}), "
          f"{len(manifest.files)} files verified")  # fmt: skip
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from edgeserve.ota.build import inspect_bundle
    from edgeserve.ota.errors import BundleRefused

    try:
        info = inspect_bundle(args.file)
    except (BundleRefused, OSError) as exc:
        return _fail(f"{args.file}: {exc}")
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = info["manifest"]
    print(f"{args.file}: {info['bytes']} bytes, signature {info['signature_bytes']} bytes")
    for key in ("name", "version", "created_at", "expires_at", "key_id", "unpacked_size"):
        print(f"  {key:14} {m.get(key)}")
    print(f"  {'security':14} {m.get('security_version', 0)}")
    print(f"  {'compatible':14} {json.dumps(m.get('compatible'))}")
    for model, versions in (m.get("models") or {}).items():
        print(f"  model {model}: versions {versions}")
    print(f"  files          {len(m.get('files') or [])}, checks {len(m.get('checks') or [])}")
    return 0


def _state_dir(args: argparse.Namespace) -> tuple[Path, Path | None]:
    _, state_dir, config, _ = _settings(args)
    return state_dir, config


def _settings(args: argparse.Namespace) -> tuple[Any, Path, Path | None, dict[str, str]]:
    """(settings, state folder, settings file) as `edgeserve run` with the same flags would see them."""
    from edgeserve.settings_tools import load_layered, resolve_state_dir

    config = getattr(args, "config", None)
    settings, sources = load_layered(config)
    state_dir = args.state_dir if args.state_dir is not None else resolve_state_dir(settings, sources)[0]
    return settings, Path(state_dir).resolve(), config, sources


class _Progress:
    """One line per state, a percentage in place on a terminal: the install shows where it is. The end
    (COMMITTED, FAILED, ROLLED_BACK) is not a phase: `_finish` prints it, once."""

    ENDS = ("COMMITTED", "FAILED", "ROLLED_BACK")

    def __init__(self) -> None:
        self.state = ""
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, state: str, progress: float | None, message: str) -> None:
        if state in self.ENDS:
            return
        now = time.monotonic()
        # Percentages are throttled; a new state or a note (no percentage) always shows.
        if state == self.state and progress is not None and now - self.last < (0.1 if self.tty else 2.0):
            return
        self.last = now
        percent = f" {progress * 100:5.1f}%" if progress is not None else ""
        line = f"{state:12}{percent} {message}"
        if self.tty:
            end = "\n" if state != self.state and self.state else ""
            print(f"{end}\r{line[:120]:120}", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)
        self.state = state

    def close(self) -> None:
        if self.tty and self.state:
            print(file=sys.stderr)


def _offline_installer(args: argparse.Namespace) -> Any:
    from edgeserve.ota.installer import Installer
    from edgeserve.ota.policy import Policy
    from edgeserve.ota.store import Store
    from edgeserve.ota.trust import trust_dir_for
    from edgeserve.supervisor.activate import OfflineActivator, TrialRunner
    from edgeserve.supervisor.report import device_accelerators

    settings, state_dir, config, sources = _settings(args)
    ota = settings.ota
    from edgeserve.repository.layout import list_models

    trial = TrialRunner(state_dir, config, load_timeout_s=ota.load_timeout_s, window_s=ota.trial_window_s)
    repository = settings.server.model_repository

    def repository_models() -> set[str]:
        # Only a configured repository: the default "models" of the current folder may not be the one
        # the appliance serves (its start refuses a clash anyway).
        configured = "server.model_repository" in sources
        return set(list_models(repository)) if configured and repository.is_dir() else set()

    store = Store(state_dir, trust_dir_for(settings, state_dir))
    return Installer(store, OfflineActivator(trial), accelerators=device_accelerators(settings),
                     policy=Policy(max_unpacked_bytes=ota.max_unpacked_mb * 2**20),
                     other_models=repository_models)  # fmt: skip


def _quiet_installer_log() -> None:
    """Offline, the installer's warnings (meant for the appliance's log) would repeat on stderr what the
    progress lines and the final line say; errors (an unexpected failure's traceback) still show."""
    import logging

    handler = logging.StreamHandler()
    handler.setLevel(logging.ERROR)
    logger = logging.getLogger("edgeserve.ota")
    logger.addHandler(handler)
    logger.propagate = False


def _through_appliance(state_dir: Path, request: dict[str, Any]) -> dict[str, Any] | None:
    from edgeserve.supervisor.ota_service import call

    progress = _Progress()
    try:
        return call(
            state_dir, request, lambda e: progress(e["state"], e.get("progress"), e.get("message", ""))
        )
    finally:
        progress.close()


def _finish(result: dict[str, Any]) -> int:
    if result.get("ok"):
        print(f"{result.get('state')}: {result.get('reason', '')}")
        return 0
    return _fail(str(result.get("reason") or result.get("error") or result.get("state")))


def _install(args: argparse.Namespace) -> int:
    state_dir, _ = _state_dir(args)
    source = args.source if "://" in args.source else str(Path(args.source).resolve())
    return _apply(
        args,
        state_dir,
        {"op": "install", "source": source, "sha256": args.sha256},
        lambda installer, progress: installer.install(source, progress, sha256=args.sha256),
    )


def _rollback(args: argparse.Namespace) -> int:
    state_dir, _ = _state_dir(args)
    return _apply(
        args,
        state_dir,
        {"op": "rollback", "to": args.to_version},
        lambda installer, progress: installer.rollback(args.to_version, progress),
    )


def _apply(
    args: argparse.Namespace,
    state_dir: Path,
    request: dict[str, Any],
    offline: Callable[[Any, _Progress], Any],
) -> int:
    """Through the running appliance when there is one; else here, after finishing an interrupted
    install, with `offline(installer, progress)`."""
    result = _through_appliance(state_dir, request)
    if result is not None:
        return _finish(result)
    from edgeserve.ota.errors import StoreError
    from edgeserve.ota.installer import recover

    _quiet_installer_log()
    progress = _Progress()
    try:
        installer = _offline_installer(args)
        with installer.store.lock():
            recover(installer.store)
        outcome = offline(installer, progress)
    except StoreError as exc:
        return _fail(str(exc))
    finally:
        progress.close()
    return _finish(outcome.to_dict())


def _integrity(store: Any) -> dict[str, dict[str, Any]]:
    """The active and previous bundles' folders against their signed manifests (every file hashed: a
    model of a bundle that does not match fails to load, and this says which file)."""
    from edgeserve.repository import bundle_files

    found: dict[str, dict[str, Any]] = {}
    for which, version in (("active", store.active()), ("previous", store.previous())):
        if version is None:
            continue
        try:
            problems = bundle_files.problems(version.path)
        except bundle_files.BundleDamaged as exc:
            problems = [str(exc)]
        if os.path.realpath(version.path.parent) != os.path.realpath(store.bundles):
            link = "current" if which == "active" else which
            problems.insert(0, f"ota/{link} points at {version.path}, not at a bundle of the store")
        found[which] = {"bundle": version.label, "ok": not problems, "problems": problems}
    return found


def _status(args: argparse.Namespace) -> int:
    from edgeserve.ota.store import Store

    state_dir, _ = _state_dir(args)
    store = Store(state_dir)
    status = store.status()
    status["state_dir"] = str(state_dir)
    status["integrity"] = _integrity(store)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    print(f"state dir        {state_dir}")
    print(f"active           {status['active'] or 'none'}")
    print(f"previous         {status['previous_version'] or 'none'}")
    print(f"state            {status['state']}")
    print(f"kept versions    {status['kept_versions']}")
    print(f"security floor   {status['security_floor']} (lower security_version bundles are refused)")
    for which, found in status["integrity"].items():
        problems = found["problems"]
        verdict = "as signed" if not problems else f"DOES NOT MATCH its signed manifest ({len(problems)}):"
        print(f"{which + ' files':16} {found['bundle']} {verdict}")
        for problem in problems[:10]:
            print(f"  {problem}")
    for entry in status["history"][-10:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.get("finished_at", 0)))
        what = f"{entry.get('name', '')} v{entry.get('version', '')}".strip()
        print(f"  {when} {entry.get('state', ''):12} {what:20} {entry.get('reason', '')}")
    return 0
