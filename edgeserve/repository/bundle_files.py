"""An installed bundle's files against its signed manifest, before a model of it loads.

The installer verified every file's size and sha256 while it unpacked the bundle (ota/archive.py) and
the folder is never edited afterwards; the folder and its files are writable by the service user only
(fsutil). This check is the second line: before a model of a bundle is loaded (at start, on a reload
over the repository API, in the trial server) and before a bundle is switched to, its folder must hold
exactly what `manifest.json` lists: no file changed, missing, added (an extra .py that model.py would
import, a `__pycache__` whose .pyc would run instead of the signed source, a new version folder), no
link, and `ota/current` must point into the bundle store. A failure names the file.

Hashing is cached per file by (device, inode, mtime_ns, size, ctime_ns): a reload of untouched files
costs one lstat each. Any write, rename over or chmod changes the ctime, which no one can set back.

Layout as ota/store.py keeps it: `<state_dir>/ota/bundles/<name>-v<N>/{manifest.json, manifest.sig,
models/<model>/...}`, `<state_dir>/ota/current -> bundles/<name>-v<N>`. The manifest's structure was
checked at install (ota/manifest.py); here only the fields this check reads are read, defensively.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from edgeserve.fsutil import sha256_fd
from edgeserve.protocol.errors import RepositoryError, Status

MANIFEST, SIGNATURE, MODELS = "manifest.json", "manifest.sig", "models"
TOP_LEVEL = frozenset({MANIFEST, SIGNATURE, MODELS})
MAX_MANIFEST_BYTES = 4 * 2**20  # as the installer's cap
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BUNDLE_DIR = re.compile(r"^.+-v[0-9]+$")
_CACHE_ENTRIES = 50_000  # files of the bundles checked in this process; past it the cache starts over

StatKey = tuple[int, int, int, int, int]


class BundleDamaged(Exception):
    """A bundle's folder does not match its signed manifest; the message names the file."""


@dataclass(frozen=True)
class Signed:
    """What the manifest says of the files: path -> (size, sha256), and the models it lists."""

    files: dict[str, tuple[int, str]]
    models: frozenset[str]


_lock = threading.Lock()
_verified: dict[str, tuple[StatKey, str]] = {}  # absolute path -> (stat key, sha256 it had then)


def _key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)


def bundle_of(model_dir: Path) -> tuple[Path, str] | None:
    """(bundle folder, model name) when `model_dir` is `<...>/ota/bundles/<name>-v<N>/models/<model>`
    (its parents resolved, the model folder itself not: a link there is for the check to refuse)."""
    models = Path(os.path.realpath(model_dir.parent))
    bundle = models.parent
    if models.name != MODELS or bundle.parent.name != "bundles" or bundle.parent.parent.name != "ota":
        return None
    return (bundle, model_dir.name) if _BUNDLE_DIR.match(bundle.name) else None


def read_signed(bundle: Path) -> Signed:
    """The manifest's file list and models (BundleDamaged when it is missing, a link or unreadable)."""
    path = bundle / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise BundleDamaged(f"{MANIFEST}: {exc.strerror or exc} (a link, or missing)") from None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(MAX_MANIFEST_BYTES + 1)
    try:
        data: Any = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_MANIFEST_BYTES else None
    except (UnicodeDecodeError, ValueError):
        data = None
    entries = data.get("files") if isinstance(data, dict) else None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not isinstance(models, dict):
        raise BundleDamaged(f"{MANIFEST}: not the manifest the installer verified (no file list)")
    files: dict[str, tuple[int, str]] = {}
    for entry in entries:
        path_value = entry.get("path") if isinstance(entry, dict) else None
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        posix = PurePosixPath(path_value) if isinstance(path_value, str) else None
        if (
            posix is None or posix.is_absolute() or ".." in posix.parts or str(posix) != path_value
            or len(posix.parts) < 3 or posix.parts[0] != MODELS or not isinstance(size, int)
            or isinstance(size, bool) or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest)
        ):  # fmt: skip
            raise BundleDamaged(f"{MANIFEST}: file entry {str(path_value)[:200]!r} is malformed")
        files[str(posix)] = (size, digest)
    return Signed(files, frozenset(str(m) for m in models))


def _digest(path: Path, st: os.stat_result) -> str | None:
    """sha256 of the regular file at `path`, None when it changed while being read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if _key(os.fstat(fh.fileno())) != _key(st):
            return None
        digest = sha256_fd(fh.fileno())
        if _key(os.fstat(fh.fileno())) != _key(st):
            return None
    return digest


def _file_problem(path: Path, relative: str, st: os.stat_result, size: int, sha256: str) -> str | None:
    if st.st_size != size:
        return f"{relative}: changed ({st.st_size} bytes, the signed manifest says {size})"
    name = str(path)
    with _lock:
        cached = _verified.get(name)
    if cached is not None and cached == (_key(st), sha256):
        return None
    actual = _digest(path, st)
    if actual is None:
        return f"{relative}: changed while it was being checked"
    if actual != sha256:
        return f"{relative}: changed (sha256 {actual[:16]}..., the signed manifest says {sha256[:16]}...)"
    with _lock:
        if len(_verified) >= _CACHE_ENTRIES:
            _verified.clear()
        _verified[name] = (_key(st), sha256)
    return None


def problems(bundle: Path, model: str | None = None, first_only: bool = False) -> list[str]:
    """What in the bundle folder differs from its manifest: the files of `model` (every model and the
    top level when None), each as "<path in the bundle>: what is wrong"."""
    signed = read_signed(bundle)
    prefix = f"{MODELS}/{model}" if model is not None else ""
    if model is not None and model not in signed.models:
        return [f"{prefix}: not a model of the signed manifest"]
    expected = {p: v for p, v in signed.files.items() if not prefix or p.startswith(prefix + "/")}
    folders = {str(parent) for p in expected for parent in PurePosixPath(p).parents} - {"."}
    found: list[str] = []
    seen: set[str] = set()
    root = bundle / prefix if prefix else bundle
    try:
        root_mode = os.lstat(root).st_mode
    except OSError as exc:
        return [f"{prefix or '.'}: {exc.strerror or exc}"]
    if not stat.S_ISDIR(root_mode):
        return [f"{prefix}: a link or a file, not the bundle's folder"]
    for folder, dirs, files in os.walk(root):
        dirs.sort()  # the same order every time: the first problem named is always the same
        for entry in sorted((*dirs, *files)):
            path = Path(folder, entry)
            relative = path.relative_to(bundle).as_posix()
            try:
                st = os.lstat(path)
            except OSError:
                found.append(f"{relative}: vanished while it was being checked")
                continue
            if not prefix and folder == str(bundle) and entry in TOP_LEVEL:
                if entry == MODELS and not stat.S_ISDIR(st.st_mode):
                    found.append(f"{relative}: not a folder")
                elif entry != MODELS and not stat.S_ISREG(st.st_mode):
                    found.append(f"{relative}: not a regular file")
                continue
            if relative in expected:
                seen.add(relative)
            if stat.S_ISDIR(st.st_mode):
                if relative not in folders:
                    found.append(f"{relative}/: a folder the signed manifest does not list")
            elif not stat.S_ISREG(st.st_mode):
                what = "a link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                listed = "a file" if relative in expected else "nothing"
                found.append(f"{relative}: {what}, where the signed manifest lists {listed}")
            elif relative not in expected:
                found.append(f"{relative}: a file the signed manifest does not list")
            else:
                problem = _file_problem(path, relative, st, *expected[relative])
                if problem is not None:
                    found.append(problem)
            if first_only and found:
                return found
    found += [f"{path}: missing" for path in sorted(set(expected) - seen)]
    return found


def remember(bundle: Path, hashed: dict[str, str]) -> None:
    """Files the caller has just hashed (the installer, as it unpacked them): their current stat goes
    into the cache, so the check before the switch does not read them again."""
    for relative, sha256 in hashed.items():
        try:
            st = os.lstat(bundle / relative)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            with _lock:
                _verified[str(bundle / relative)] = (_key(st), sha256)


def check_model_folder(state_dir: Path, model_dir: Path) -> None:
    """Before a model loads from `model_dir`: BundleDamaged naming the file when it is a model folder of
    an installed bundle that differs from its manifest, or of an `ota/current` that points outside the
    bundle store. Model folders of the local model repository are not bundles: nothing to check."""
    current = state_dir / "ota" / "current"
    if current.is_symlink():
        target = Path(os.path.realpath(current))
        if Path(os.path.realpath(model_dir.parent)).is_relative_to(target):
            store = Path(os.path.realpath(state_dir / "ota" / "bundles"))
            if target.parent != store or not _BUNDLE_DIR.match(target.name):
                raise BundleDamaged(f"ota/current points at {target}, not at a bundle of the store {store}")
    found = bundle_of(model_dir)
    if found is None:
        return
    bundle, model = found
    wrong = problems(bundle, model, first_only=True)
    if wrong:
        raise BundleDamaged(f"bundle {bundle.name}: {wrong[0]}")


def check_source(name: str, state_dir: Path, model_dir: Path) -> None:
    """`check_model_folder` for the repository: PERMISSION_DENIED naming the model and the file."""
    try:
        check_model_folder(state_dir, model_dir)
    except BundleDamaged as exc:
        raise RepositoryError(f"model '{name}'", "", f"{exc}; install the bundle again (or roll back)",
                              Status.PERMISSION_DENIED) from None  # fmt: skip
