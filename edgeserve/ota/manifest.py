"""`manifest.json` (bundle format 1): parse and check every field once, with a reason per refusal.

Layout (fixed, other tools build and check bundles): format, name, version, created_at, expires_at,
compatible {arch, accelerators?, min_edgeserve}, models {name: [versions]}, files [{path, sha256,
size}], unpacked_size, key_id, checks? (sample inputs, expected outputs, tolerance), security_version?
(0 when absent: manifests signed before it existed stay valid).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

from edgeserve.ota.errors import BundleRefused

FORMAT = 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
KEY_ID_RE = re.compile(r"^[0-9a-f]{16}$")
MAX_SECURITY_VERSION = 2**31 - 1


@dataclass(frozen=True)
class FileEntry:
    path: str  # "models/<model>/..." (POSIX, relative)
    sha256: str
    size: int


@dataclass(frozen=True)
class Check:
    """One sample request run during the trial: inputs -> expected outputs within a tolerance."""

    model: str
    inputs: list[dict[str, Any]]  # KServe V2 JSON tensors: name, datatype, shape, data
    expected: dict[str, list[Any]]  # output name -> flat values
    tolerance: float = 1e-3


@dataclass(frozen=True)
class Manifest:
    name: str
    version: int
    created_at: datetime
    expires_at: datetime
    arch: list[str]
    accelerators: list[str]
    min_edgeserve: str
    models: dict[str, list[int]]
    files: list[FileEntry]
    unpacked_size: int
    key_id: str
    checks: list[Check] = field(default_factory=list)
    # Across bundle names: a device refuses a bundle below the highest security_version it committed.
    security_version: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# RFC 3339's date-time; the offset is optional here so that a time without one is named as such.
_RFC3339 = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt](\d{2}:\d{2}:\d{2})(?:\.(\d+))?([Zz]|[+-]\d{2}:\d{2})?", re.ASCII
)


def parse_rfc3339(value: str) -> datetime:
    """An RFC 3339 time, read the same on every Python: 3.10's fromisoformat takes only 0, 3 or 6
    fraction digits (Go's RFC3339Nano writes ".5Z"), 3.11's also takes ISO 8601 forms RFC 3339 does not
    ("20250101T000000Z"). Naive when the offset is missing; ValueError when it is not one."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    date, clock, fraction, offset = match.groups()
    fraction = f".{(fraction + '00000')[:6]}" if fraction else ""  # microseconds, as 3.11 cuts
    offset = "+00:00" if offset in ("Z", "z") else offset or ""
    return datetime.fromisoformat(f"{date}T{clock}{fraction}{offset}")


def parse_time(value: Any, where: str) -> datetime:
    if not isinstance(value, str):
        raise BundleRefused("manifest", f"{where} must be an RFC 3339 UTC time string")
    try:
        moment = parse_rfc3339(value)
    except ValueError:
        raise BundleRefused("manifest", f"{where} {value!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise BundleRefused("manifest", f"{where} {value!r} has no time zone (use Z)")
    return moment.astimezone(timezone.utc)


def check_member_path(path: str) -> PurePosixPath:
    """A bundle path: relative, under models/, no "..", no empty or odd parts."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        raise BundleRefused("path", f"bad path {path!r}")
    posix = PurePosixPath(path)
    if posix.is_absolute():
        raise BundleRefused("path", f"absolute path {path!r}")
    parts = posix.parts
    if ".." in parts or "." in parts or path != str(posix):
        raise BundleRefused("path", f"path {path!r} is not a plain relative path (.., ., //)")
    if len(parts) < 3 or parts[0] != "models":
        raise BundleRefused("path", f"path {path!r} is not a file under models/<model>/")
    return posix


def _require(data: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise BundleRefused(
            "manifest", f"field '{key}' is missing or not a {getattr(kind, '__name__', kind)}"
        )
    return value


def _checks(value: Any, models: dict[str, list[int]]) -> list[Check]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BundleRefused("manifest", "'checks' must be a list")
    checks: list[Check] = []
    for i, item in enumerate(value):
        where = f"checks[{i}]"
        if not isinstance(item, dict):
            raise BundleRefused("manifest", f"{where} must be an object")
        model = item.get("model")
        if model not in models:
            raise BundleRefused("manifest", f"{where}.model {model!r} is not a model of this bundle")
        inputs, expected = item.get("inputs"), item.get("expected")
        if not isinstance(inputs, list) or not all(isinstance(t, dict) for t in inputs):
            raise BundleRefused("manifest", f"{where}.inputs must be a list of V2 JSON tensors")
        if not isinstance(expected, dict) or not all(isinstance(v, list) for v in expected.values()):
            raise BundleRefused("manifest", f"{where}.expected must map output names to value lists")
        tolerance = item.get("tolerance", 1e-3)
        if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or tolerance < 0:
            raise BundleRefused("manifest", f"{where}.tolerance must be a number >= 0")
        checks.append(Check(str(model), inputs, expected, float(tolerance)))
    return checks


def check_security_version(value: Any) -> int:
    """0..2**31-1, an integer (not a bool, not a float); refusal names the field and the range."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SECURITY_VERSION:
        raise BundleRefused(
            "manifest", f"security_version {value!r} must be an integer from 0 to {MAX_SECURITY_VERSION}"
        )
    return value


def parse_manifest(raw: bytes) -> Manifest:
    """Structure and types only; policy (expiry, sizes, compatibility) is checked by the installer."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleRefused("manifest", f"manifest.json is not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BundleRefused("manifest", "manifest.json must be a JSON object")
    if data.get("format") != FORMAT:
        raise BundleRefused(
            "manifest", f"unknown bundle format {data.get('format')!r} (this edgeserve reads 1)"
        )
    name = _require(data, "name", str)
    if not NAME_RE.match(name):
        raise BundleRefused("manifest", f"bundle name {name!r} must be letters, digits, '.', '_', '-'")
    version = _require(data, "version", int)
    if version < 1:
        raise BundleRefused("manifest", "version must be a positive integer")
    compatible = _require(data, "compatible", dict)
    arch = compatible.get("arch")
    if not isinstance(arch, list) or not arch or not all(isinstance(a, str) for a in arch):
        raise BundleRefused("manifest", "compatible.arch must be a non-empty list of architectures")
    accelerators = compatible.get("accelerators", [])
    if not isinstance(accelerators, list) or not all(isinstance(a, str) for a in accelerators):
        raise BundleRefused("manifest", "compatible.accelerators must be a list of strings")
    min_edgeserve = compatible.get("min_edgeserve", "0")
    if not isinstance(min_edgeserve, str) or not re.match(r"^\d+(\.\d+)*$", min_edgeserve):
        raise BundleRefused("manifest", "compatible.min_edgeserve must be a version like 0.1.0")
    models_raw = _require(data, "models", dict)
    models: dict[str, list[int]] = {}
    for model, versions in models_raw.items():
        ok = (
            isinstance(versions, list)
            and versions
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in versions)
        )
        if not NAME_RE.match(model) or not ok:
            raise BundleRefused("manifest", f"models.{model}: a model name with a list of positive versions")
        models[model] = sorted(set(versions))
    files: list[FileEntry] = []
    for i, entry in enumerate(_require(data, "files", list)):
        if not isinstance(entry, dict):
            raise BundleRefused("manifest", f"files[{i}] must be an object")
        path, digest, size = entry.get("path"), entry.get("sha256"), entry.get("size")
        check_member_path(path)  # type: ignore[arg-type]
        if not isinstance(digest, str) or not SHA256_RE.match(digest):
            raise BundleRefused("manifest", f"files[{i}].sha256 must be 64 lowercase hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BundleRefused("manifest", f"files[{i}].size must be an integer >= 0")
        files.append(FileEntry(str(path), digest, size))
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise BundleRefused("duplicate", "the manifest lists a file twice")
    folders = {str(parent) for path in paths for parent in PurePosixPath(path).parents}
    clash = next((path for path in paths if path in folders), None)
    if clash is not None:
        raise BundleRefused("duplicate", f"the manifest lists {clash} both as a file and as a folder")
    for path in paths:
        if path.split("/")[1] not in models:
            raise BundleRefused("manifest", f"file {path} belongs to no model listed in 'models'")
    unpacked = _require(data, "unpacked_size", int)
    if unpacked != sum(f.size for f in files):
        raise BundleRefused("manifest", "unpacked_size is not the sum of the file sizes")
    key_id = _require(data, "key_id", str)
    if not KEY_ID_RE.match(key_id):
        raise BundleRefused("manifest", "key_id must be 16 lowercase hex digits")
    return Manifest(
        name=name,
        version=version,
        created_at=parse_time(data.get("created_at"), "created_at"),
        expires_at=parse_time(data.get("expires_at"), "expires_at"),
        arch=list(arch),
        accelerators=list(accelerators),
        min_edgeserve=min_edgeserve,
        models=models,
        files=files,
        unpacked_size=unpacked,
        key_id=key_id,
        checks=_checks(data.get("checks"), models),
        security_version=check_security_version(data.get("security_version", 0)),
        raw=data,
    )


def dump_manifest(data: dict[str, Any]) -> bytes:
    """The exact bytes that are signed: compact, sorted keys, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
