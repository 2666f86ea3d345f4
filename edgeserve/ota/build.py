"""Fleet side: build and sign a bundle from a model repository; verify and inspect one."""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from edgeserve import __version__
from edgeserve.fsutil import sha256_file
from edgeserve.ota.archive import add_bytes, read_header
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import (
    FORMAT,
    Manifest,
    check_security_version,
    dump_manifest,
    parse_manifest,
    rfc3339,
)
from edgeserve.ota.signing import key_id, load_private, verify

DEFAULT_ARCH = ["x86_64", "aarch64"]
DEFAULT_LIFETIME = timedelta(days=90)


def parse_expiry(value: str | None, now: datetime) -> datetime:
    """ "30d", "12h", "90m" from now, or an RFC 3339 time; default 90 days."""
    if not value:
        return now + DEFAULT_LIFETIME
    match = re.fullmatch(r"(\d+)([dhm])", value)
    if match:
        amount, unit = int(match.group(1)), match.group(2)
        return (
            now
            + {"d": timedelta(days=amount), "h": timedelta(hours=amount), "m": timedelta(minutes=amount)}[
                unit
            ]
        )
    moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _model_files(repo: Path, model: str) -> tuple[list[Path], list[int]]:
    folder = repo / model
    if not folder.is_dir():
        raise ValueError(f"no model folder {folder}")
    files: list[Path] = []
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path} is a symlink: bundles carry regular files only")
        if path.is_file():
            files.append(path)
    versions = sorted(
        int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0
    )
    if not versions:
        raise ValueError(f"{folder} has no numeric version folder")
    return files, versions


def _calibration_files(
    folders: dict[str, Path], models: list[str], taken: set[str]
) -> list[tuple[str, Path]]:
    """(member, file) for each sample file of `--calibration MODEL=DIR` (sample and image files only)."""
    if not folders:
        return []
    from edgeserve.bench.calibration import CALIBRATION_DIR, SAMPLE_SUFFIXES
    from edgeserve.bench.inputs import IMAGE_SUFFIXES

    found: list[tuple[str, Path]] = []
    for model, folder in sorted(folders.items()):
        if model not in models:
            raise ValueError(f"--calibration {model}={folder}: {model} is not a model of this bundle")
        if not folder.is_dir():
            raise ValueError(f"--calibration {model}={folder}: not a folder")
        for path in sorted(folder.rglob("*")):
            if path.is_symlink():
                raise ValueError(f"{path} is a symlink: bundles carry regular files only")
            if not path.is_file() or path.suffix.lower() not in SAMPLE_SUFFIXES | IMAGE_SUFFIXES:
                continue
            member = f"models/{model}/{CALIBRATION_DIR}/{path.relative_to(folder).as_posix()}"
            if member in taken:
                raise ValueError(f"--calibration {model}={folder}: {member} is in the repository too")
            found.append((member, path))
        if not any(m.startswith(f"models/{model}/") for m, _ in found):
            raise ValueError(f"--calibration {model}={folder}: no .npy, .npz or image files in it")
    return found


@dataclass
class BuildRequest:
    repo: Path
    name: str
    version: int
    key: Path
    out: Path
    models: list[str] | None = None
    arch: list[str] | None = None
    accelerators: list[str] | None = None
    min_edgeserve: str = __version__
    expires: str | None = None
    checks: Path | None = None
    compress: bool = True
    security_version: int = 0  # raise it when a bundle fixes a vulnerability: older ones stop installing
    # model -> folder of INT8 calibration samples, carried as models/<model>/calibration/ (signed like
    # every file) for `edgeserve tune --int8` on the device
    calibration: dict[str, Path] | None = None


def build_bundle(request: BuildRequest) -> dict[str, Any]:
    """Write the signed bundle; returns its manifest."""
    check_security_version(request.security_version)  # before hashing gigabytes
    private = load_private(request.key)
    repo = request.repo
    names = request.models or sorted(
        p.name for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")
    )
    files: list[dict[str, Any]] = []
    sources: list[tuple[str, Path]] = []
    models: dict[str, list[int]] = {}
    for model in names:
        paths, versions = _model_files(repo, model)
        models[model] = versions
        for path in paths:
            member = f"models/{model}/{path.relative_to(repo / model).as_posix()}"
            files.append({"path": member, "sha256": sha256_file(path), "size": path.stat().st_size})
            sources.append((member, path))
    for member, path in _calibration_files(request.calibration or {}, names, {m for m, _ in sources}):
        files.append({"path": member, "sha256": sha256_file(path), "size": path.stat().st_size})
        sources.append((member, path))
    now = datetime.now(timezone.utc).replace(microsecond=0)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "name": request.name,
        "version": int(request.version),
        "created_at": rfc3339(now),
        "expires_at": rfc3339(parse_expiry(request.expires, now)),
        "compatible": {"arch": request.arch or DEFAULT_ARCH, "min_edgeserve": request.min_edgeserve},
        "models": models,
        "files": files,
        "unpacked_size": sum(f["size"] for f in files),
        "key_id": key_id(private.public_key()),
        "security_version": request.security_version,
    }
    if request.accelerators:
        manifest["compatible"]["accelerators"] = request.accelerators
    if request.checks is not None:
        manifest["checks"] = json.loads(request.checks.read_text())
    body = dump_manifest(manifest)
    parse_manifest(body)  # what we sign must be what devices accept
    signature = private.sign(body)
    request.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = request.out.with_name(request.out.name + ".tmp")
    mtime = now.timestamp()
    with open(tmp, "wb") as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="wb", mtime=int(mtime)) if request.compress else raw
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            add_bytes(tar, "manifest.json", body, mtime)
            add_bytes(tar, "manifest.sig", signature, mtime)
            for member, path in sources:
                info = tarfile.TarInfo(member)
                info.size, info.mode, info.mtime = path.stat().st_size, 0o644, mtime
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
        if stream is not raw:
            stream.close()
    tmp.replace(request.out)
    return manifest


def verify_bundle(path: Path, trust_dir: Path) -> tuple[Manifest, str]:
    """Signature and manifest structure (the file hashes are checked as an install extracts them)."""
    body, signature = read_header(path)
    try:
        declared = json.loads(body).get("key_id", "")
    except (ValueError, AttributeError):
        declared = ""
    trusted = verify(body, signature, str(declared), trust_dir)
    return parse_manifest(body), trusted.path.name


def inspect_bundle(path: Path) -> dict[str, Any]:
    body, signature = read_header(path)
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise BundleRefused("manifest", f"manifest.json is not JSON: {exc}") from None
    return {
        "file": str(path),
        "bytes": path.stat().st_size,
        "signature_bytes": len(signature),
        "manifest": data,
    }
