"""The device-side check path that hostile bundles run (test_hostile_bundles.py, test_hostile_archives.py)
and what every refusal must meet: a BundleRefused with the expected reason, a one-line message naming the
problem, and nothing written outside the staging folder.

The path an installer runs, in this order (`check`): archive.read_header -> signing.verify ->
manifest.parse_manifest -> policy.check_manifest -> archive.extract into a fresh staging folder.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hostile import Member, Signer, make_signer, make_trust_dir, manifest_for, regular

from edgeserve.ota import archive, manifest, policy, signing
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import Manifest
from edgeserve.ota.policy import Policy

MODEL = bytes(range(256)) * 64 + b"weights"  # 16391 bytes
CONFIG = b'name: "m"\nmax_batch_size: 8\n'
FILES = [("models/m/1/model.bin", MODEL), ("models/m/config.pbtxt", CONFIG)]
ARCH = "x86_64"
SIGNATURE_WORDS = r"signature|signed|key"


# ------------------------------------------------------------------------------- the device's path
def check(
    path: Path,
    *,
    trust_dir: Path,
    staging: Path,
    installed: dict[str, int] | None = None,
    policy_: Policy | None = None,
    arch: str = ARCH,
    accelerators: set[str] | None = None,
    now: datetime | None = None,
) -> BundleRefused | Manifest:
    """Steps 1-5 of an install; returns the refusal (any other exception is a bug and propagates)."""
    try:
        body, sig = archive.read_header(path)
        try:  # the installer must not crash on a manifest that is not a JSON object with a key_id
            declared = json.loads(body).get("key_id", "")
        except (ValueError, AttributeError):
            declared = ""
        signing.verify(body, sig, str(declared), trust_dir)
        parsed = manifest.parse_manifest(body)
        policy.check_manifest(
            parsed,
            installed_versions=dict(installed or {}),
            policy=policy_ or Policy(),
            arch=arch,
            accelerators=accelerators,
            now=now,
        )
        archive.extract(path, parsed, staging)
    except BundleRefused as exc:
        return exc
    return parsed


def snapshot(root: Path, exclude: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under `root` (not following links) with type, size, mode and mtime; `exclude` left out."""
    seen: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d != exclude]
        for name in dirs + files:
            full = here / name
            if full == exclude:
                continue
            st = full.lstat()
            if full.is_dir() and not full.is_symlink():  # its listing is covered by the paths below it
                seen[str(full.relative_to(root))] = (st.st_mode,)
            else:
                seen[str(full.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def staged_bytes(staging: Path) -> int:
    if not staging.exists():
        return 0
    return sum(p.lstat().st_size for p in staging.rglob("*") if p.is_file() and not p.is_symlink())


@dataclass
class Env:
    root: Path
    signer: Signer
    other_trusted: Signer
    intruder: Signer
    trust_dir: Path
    staging: Path
    now: datetime

    def check(self, path: Path, **kwargs: Any) -> BundleRefused | Manifest:
        kwargs.setdefault("now", self.now)
        return check(path, trust_dir=self.trust_dir, staging=self.staging, **kwargs)

    def manifest(self, files: Any = FILES, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("key_id", self.signer.key_id)
        kwargs.setdefault("now", self.now)
        return manifest_for(files, **kwargs)

    def outside_path(self, label: str) -> Path:
        """A unique path under tmp_path (outside staging) that an escape would create."""
        return self.root / f"{label}-{uuid.uuid4().hex[:12]}"

    def refused(
        self,
        path: Path,
        reason: str | tuple[str, ...],
        words: str,
        *,
        outside: tuple[Path, ...] | list[Path] = (),
        extracted: bool = True,
        **kwargs: Any,
    ) -> BundleRefused:
        """Run the check and assert a clean refusal; `extracted=False`: staging must not even exist."""
        before = snapshot(self.root, self.staging)
        untouched = {
            p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in outside if p.exists()
        }
        result = self.check(path, **kwargs)
        after = snapshot(self.root, self.staging)
        assert isinstance(result, BundleRefused), f"accepted: {result.name} v{result.version}"
        reasons = (reason,) if isinstance(reason, str) else reason
        assert result.reason in reasons, f"reason {result.reason!r}, wanted {reasons}: {result}"
        message = result.message
        assert message and message.strip() == message, repr(message)
        assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
        assert re.search(words, message, re.IGNORECASE), f"{message!r} does not name the problem ({words})"
        assert after == before, f"written outside staging: {set(after) ^ set(before)}"
        for target in outside:
            if target in untouched:
                mode, data = untouched[target]
                assert target.lstat().st_mode == mode
                assert (target.read_bytes() if target.is_file() else None) == data, f"{target} was changed"
            else:
                assert not os.path.lexists(target), f"{target} was created outside staging"
        if not extracted:
            assert not self.staging.exists(), "something was extracted from a bundle that was refused"
        return result


def good_members(files: list[tuple[str, bytes]] = FILES) -> list[Member]:
    return [regular(path, data) for path, data in files]


def make_env(tmp_path: Path) -> Env:
    """Three keys (two trusted: a rotation), the device's trust folder and an empty staging folder."""
    keys = tmp_path / "keys"
    signer = make_signer(keys, "fleet")
    other = make_signer(keys, "fleet-next")  # also trusted (key rotation)
    intruder = make_signer(keys, "intruder")
    trust = make_trust_dir(tmp_path / "state" / "trust", [signer, other])
    return Env(
        root=tmp_path,
        signer=signer,
        other_trusted=other,
        intruder=intruder,
        trust_dir=trust,
        staging=tmp_path / "state" / "staging",
        now=datetime.now(timezone.utc).replace(microsecond=0),
    )
