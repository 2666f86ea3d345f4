"""The device's trust store: which public keys may sign what, and which the fleet revoked.

    <trust_dir>/bundles/*.pub         keys that sign bundles
    <trust_dir>/commands/*.pub        keys that sign fleet commands and desired states
    <state_dir>/revoked-keys.json     key ids revoked by a `revoke_key` command, per role

`[ota] trust_dir` (default `<state_dir>/trust`); the systemd install keeps it in `/etc/edgeserve/trust`,
read-only to the service. A key folder holds one key per `*.pub` file, each file exactly one PEM
Ed25519 public key (`edgeserve keygen` writes them); anything else is ignored with a warning.
The roles are separate: a key in `commands/` does not verify a bundle, nor the reverse, unless the
same file is placed in both on purpose.

Before this layout, bundle keys lay directly in `<state_dir>/trust/*.pub`. Such a folder without a
`bundles/` beneath is still read, for bundles only, with a deprecation warning.

A revocation is written atomically (fsync, rename) into the state folder, so it survives restarts and
power cuts, and holds even while the revoked key's file stays in the read-only trust folder. No command
undoes it: an operator removes the entry from the file on the device. An unreadable revocation file
refuses every bundle (fail closed).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.fsutil import write_json_atomic
from edgeserve.ota import signing
from edgeserve.ota.errors import BundleRefused

if TYPE_CHECKING:
    from edgeserve.config import Settings

log = logging.getLogger("edgeserve.ota")

BUNDLES, COMMANDS = "bundles", "commands"
FOLDER_OF = {"bundle": BUNDLES, "command": COMMANDS}
REVOKED_FILE = "revoked-keys.json"


def default_trust_dir(state_dir: Path) -> Path:
    return state_dir / "trust"


def trust_dir_for(settings: Settings, state_dir: Path) -> Path:
    """`[ota] trust_dir`, else `<state_dir>/trust`."""
    return settings.ota.trust_dir or default_trust_dir(state_dir)


def log_file_problem(settings: Settings, state_dir: Path) -> str | None:
    """Why `[logging] file` may not be used, or None. A log file in a key folder would let anyone who
    gets text into a log line (a command id, a URL) plant a key there."""
    if settings.logging.file is None:
        return None
    log_file = Path(os.path.realpath(settings.logging.file))
    for folder in {trust_dir_for(settings, state_dir), default_trust_dir(state_dir)}:
        real = Path(os.path.realpath(folder))
        if log_file == real or log_file.is_relative_to(real):
            return (
                f"logging.file {settings.logging.file} is inside the trust folder {folder}: "
                "a log line there could become a trusted key; log elsewhere (or to the journal)"
            )
    return None


class TrustStore:
    def __init__(self, trust_dir: Path, state_dir: Path) -> None:
        self.trust_dir = trust_dir
        self.revoked_path = state_dir / REVOKED_FILE

    # -- keys ---------------------------------------------------------------------------------------
    def folder(self, role: str) -> Path:
        return self.trust_dir / FOLDER_OF[role]

    def bundle_folder(self) -> Path:
        """`bundles/`, or the old flat layout (keys directly in the trust folder) with a warning."""
        folder = self.folder("bundle")
        flat = sorted(p.name for p in self.trust_dir.glob("*.pub")) if self.trust_dir.is_dir() else []
        if folder.is_dir() or not flat:
            if flat:
                signing.warn_once(f"trust: {', '.join(flat)} in {self.trust_dir} ignored: keys go in "
                                  f"{folder}/ or {self.folder('command')}/")  # fmt: skip
            return folder
        signing.warn_once(f"trust: deprecated layout: bundle keys directly in {self.trust_dir}; move them to "
                          f"{folder}/ (read as bundle keys only, never as command keys)")  # fmt: skip
        return self.trust_dir

    def bundle_keys(self) -> dict[str, signing.TrustedKey]:
        return signing.trusted_keys(self.bundle_folder(), "bundle")

    def verify_bundle(
        self, manifest_bytes: bytes, signature: bytes, declared_key_id: str
    ) -> signing.TrustedKey:
        revoked = {k: _describe(v) for k, v in self.revoked("bundle").items()}
        return signing.verify(manifest_bytes, signature, declared_key_id, self.bundle_folder(), revoked)

    # -- revocations --------------------------------------------------------------------------------
    def _read_revocations(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.revoked_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise BundleRefused(
                "revoked",
                f"the revocation list {self.revoked_path} is unreadable ({exc}): every bundle is refused",
            ) from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise BundleRefused(
                "revoked", f"the revocation list {self.revoked_path} is malformed: every bundle is refused"
            )
        return data

    def revoked(self, role: str) -> dict[str, dict[str, Any]]:
        """key id -> {at, by} of the keys revoked for `role` (BundleRefused when unreadable)."""
        entries = self._read_revocations().get(role, {})
        return {str(k): v if isinstance(v, dict) else {} for k, v in entries.items()}

    def revoke(self, key_id: str, role: str, by: str) -> dict[str, Any]:
        """Revoke `key_id` for `role` for good (persisted before this returns); idempotent."""
        data = self._read_revocations()
        entries = data.setdefault(role, {})
        known = key_id in self.keys_of(role)
        if key_id in entries:
            return {"key_id": key_id, "role": role, "revoked": True, "already": True, "known_here": known}
        entries[key_id] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": by}
        write_json_atomic(self.revoked_path, data)
        log.warning("trust: %s key %s revoked by %s", role, key_id, by)
        return {"key_id": key_id, "role": role, "revoked": True, "already": False, "known_here": known}

    def keys_of(self, role: str) -> dict[str, signing.TrustedKey]:
        if role == "bundle":
            return self.bundle_keys()
        return signing.trusted_keys(self.folder(role), role)

    # -- what was installed with a key that is now revoked -----------------------------------------
    @staticmethod
    def signer_of(bundle_dir: Path) -> str | None:
        """The key id an installed bundle's manifest names (the key that signed it)."""
        try:
            data = json.loads((bundle_dir / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        value = data.get("key_id") if isinstance(data, dict) else None
        return value if isinstance(value, str) else None

    def revoked_signer(self, bundle_dir: Path) -> str | None:
        """The revoked key that signed this installed bundle, or None (an unreadable list counts as
        revoking everything: fail closed)."""
        signer = self.signer_of(bundle_dir)
        try:
            revoked = self.revoked("bundle")
        except BundleRefused:
            return signer or "?"
        return signer if signer in revoked else None

    def describe(self, active: Path | None) -> dict[str, Any]:
        """For the fleet's `info` and health: the keys, the revocations, the active bundle's signer."""
        try:
            revoked: Mapping[str, Any] = self.revoked("bundle")
            problem = None
        except BundleRefused as exc:
            revoked, problem = {}, str(exc)
        signer = self.signer_of(active) if active is not None else None
        out: dict[str, Any] = {
            "trust_dir": str(self.trust_dir),
            "bundle_keys": sorted(self.bundle_keys()),
            "revoked_bundle_keys": sorted(revoked),
            "active_signed_by": signer,
            "active_signer_revoked": bool(problem) or (signer is not None and signer in revoked),
        }
        if problem:
            out["problem"] = problem
        return out


def _describe(entry: Mapping[str, Any]) -> str:
    return f"revoked at {entry.get('at', '?')} by {entry.get('by', '?')}"
