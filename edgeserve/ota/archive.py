"""The `.esb` file: a POSIX tar (optionally gzip, told by its magic bytes) whose first member is
`manifest.json`, second `manifest.sig`, then the model files under `models/`.

Reading never trusts the archive: the decompressed stream is capped, members are checked against an
allowlist of our own (regular files the manifest lists, and only the folders their paths imply; no
links, devices, FIFOs, setuid bits, duplicates, absolute paths, ".." or a landing place outside the
install folder), tarfile's `data_filter` is applied on top where the Python has it (not Debian 12's
3.11.2), and every byte written is counted and hashed against the signed manifest.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO, cast

from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import Manifest, check_member_path

GZIP_MAGIC = b"\x1f\x8b"
MAX_MANIFEST_BYTES = 4 * 2**20
CHUNK = 1 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# What a cut-off or damaged archive raises while it is read.
CORRUPT = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


class _CappedReader(io.RawIOBase):
    """Counts what the tar reader pulls (after decompression) and stops a bomb at `cap` bytes."""

    def __init__(self, inner: IO[bytes], cap: int) -> None:
        self.inner, self.cap, self.count = inner, cap, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(min(len(buffer), self.cap + 1 - self.count))
        self.count += len(data)
        if self.count > self.cap:
            raise BundleRefused(
                "bomb", f"the archive expands past {self.cap} bytes (its manifest promises less)"
            )
        buffer[: len(data)] = data
        return len(data)


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == GZIP_MAGIC


def _open_stream(path: Path, cap: int) -> tuple[BinaryIO, tarfile.TarFile]:
    raw: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed by the caller with the tar
    try:
        magic = raw.read(2)
        raw.seek(0)
        inner: IO[bytes] = raw
        if magic == GZIP_MAGIC:
            inner = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
        capped = io.BufferedReader(_CappedReader(inner, cap), buffer_size=CHUNK)
        return raw, tarfile.open(fileobj=capped, mode="r|")
    except EOFError as exc:
        raw.close()
        raise BundleRefused("truncated", f"the bundle ends early: {exc}") from None
    except (tarfile.TarError, OSError) as exc:
        raw.close()
        raise BundleRefused("format", f"not a bundle (tar or tar.gz): {exc}") from None


@contextmanager
def _reading(path: Path, cap: int, corrupt: str) -> Iterator[tarfile.TarFile]:
    """The archive as a tar stream; a cut-off or damaged one is refused as "truncated" (`corrupt`: why)."""
    raw, tar = _open_stream(path, cap)
    try:
        yield tar
    except CORRUPT as exc:
        raise BundleRefused("truncated", f"{corrupt}: {exc}") from None
    finally:
        tar.close()
        raw.close()


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise BundleRefused("format", f"{member.name} is not a regular file")
    return handle.read(limit + 1)


def read_header(path: Path) -> tuple[bytes, bytes]:
    """(manifest.json bytes, manifest.sig bytes): the first two members, size-capped."""
    members = []
    with _reading(path, MAX_MANIFEST_BYTES + 64 * 1024, "the bundle cannot be read") as tar:
        try:
            for member in tar:
                members.append(
                    (member, _read_member(tar, member, MAX_MANIFEST_BYTES) if member.isreg() else b"")
                )
                if len(members) == 2:
                    break
        except BundleRefused as exc:
            if exc.reason == "bomb":
                raise BundleRefused(
                    "manifest", f"manifest.json is larger than {MAX_MANIFEST_BYTES} bytes"
                ) from None
            raise
    names = [m.name for m, _ in members]
    if len(members) < 1 or names[0] != "manifest.json" or not members[0][0].isreg():
        raise BundleRefused(
            "format", f"the first member must be manifest.json (found {names[:1] or 'nothing'})"
        )
    if len(members[0][1]) > MAX_MANIFEST_BYTES:
        raise BundleRefused("manifest", f"manifest.json is larger than {MAX_MANIFEST_BYTES} bytes")
    if len(members) < 2 or names[1] != "manifest.sig" or not members[1][0].isreg():
        raise BundleRefused("signature", "unsigned bundle: the second member must be manifest.sig")
    return members[0][1], members[1][1][:1024]


def extract(path: Path, manifest: Manifest, dest: Path, progress: Progress | None = None) -> None:
    """Unpack the models/ files into `dest` (a fresh, empty folder), checking each against the manifest."""
    expected = {f.path: f for f in manifest.files}
    # The only folders a bundle may carry: those the signed file list implies.
    folders = {str(parent) for path in expected for parent in PurePosixPath(path).parents} - {"."}
    total = manifest.unpacked_size
    # Tar headers and padding: 3 blocks a member is generous (pax headers for long names).
    cap = total + MAX_MANIFEST_BYTES + 2048 * (len(expected) + 16) + 64 * 1024
    dest.mkdir(parents=True, exist_ok=False)
    seen: set[str] = set()
    written = 0
    with _reading(path, cap, "the archive ends early or is corrupt") as tar:
        for index, member in enumerate(tar):
            if index < 2:
                if member.name != ("manifest.json", "manifest.sig")[index]:
                    raise BundleRefused("format", f"member {index + 1} is {member.name!r}, not the manifest")
                continue
            name = member.name.rstrip("/") if member.isdir() else member.name
            _check_member(member, name, dest)
            if name in seen:
                raise BundleRefused("duplicate", f"{name} appears twice in the archive")
            seen.add(name)
            if member.isdir():
                if name.split("/")[0] != "models":
                    raise BundleRefused("path", f"folder {name!r} is outside models/")
                if name not in folders:  # an empty model version or stray folder would be served
                    raise BundleRefused(
                        "extra", f"folder {name} is in the archive but holds no file of the signed manifest"
                    )
                try:
                    (dest / name).mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise BundleRefused(
                        "duplicate", f"folder {name} clashes with a file of that name"
                    ) from None
                continue
            entry = expected.get(name)
            if entry is None:
                raise BundleRefused("extra", f"{name} is in the archive but not in the signed manifest")
            if member.size != entry.size:
                raise BundleRefused("size", f"{name} is {member.size} bytes, the manifest says {entry.size}")
            written += _write_file(tar, member, dest / name, entry.sha256, entry.size)
            if progress is not None:
                progress(written, total)
        # Read to the end: gzip checks its CRC and length only there (a cut or padded download).
        stream = tar.fileobj
        while stream is not None and stream.read(CHUNK):
            pass
    missing = sorted(set(expected) - seen)
    if missing:
        raise BundleRefused(
            "missing", f"{len(missing)} file(s) of the manifest are not in the archive: {missing[0]}"
        )


def _check_member(member: tarfile.TarInfo, name: str, dest: Path) -> None:
    if member.issym() or member.islnk():
        raise BundleRefused("link", f"{name} is a {'symlink' if member.issym() else 'hard link'}")
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise BundleRefused("device", f"{name} is a device node or FIFO")
    if not (member.isreg() or member.isdir()):
        raise BundleRefused("type", f"{name} is not a regular file or folder (tar type {member.type!r})")
    if member.mode & 0o7000:
        raise BundleRefused("setuid", f"{name} has setuid/setgid/sticky bits ({oct(member.mode)})")
    if member.isreg():
        check_member_path(name)
    else:
        _check_folder_path(name)
    _check_inside(name, dest)
    # tarfile's own filter on top of ours where this Python has it: it arrived in 3.11.4 (and 3.10.12);
    # Debian 12's 3.11.2 lacks it, and the checks above are the whole guarantee there. Looked up per
    # call so that the tests can hide it.
    data_filter: Callable[[tarfile.TarInfo, str], tarfile.TarInfo] | None = getattr(
        tarfile, "data_filter", None
    )
    if data_filter is None:
        return
    try:
        data_filter(member, str(dest))
    except tarfile.TarError as exc:  # FilterError and its kinds (3.11.4+) are TarErrors
        raise BundleRefused("path", f"{name}: {exc}") from None


def _check_folder_path(name: str) -> None:
    """A folder's name: check_member_path's rules except depth ("models" and "models/m" are folders)."""
    if not name or "\\" in name or "\0" in name:
        raise BundleRefused("path", f"bad folder name {name!r}")
    posix = PurePosixPath(name)
    if posix.is_absolute() or ".." in posix.parts or "." in posix.parts or name != str(posix):
        raise BundleRefused("path", f"folder {name!r} is not a plain relative path")


def _check_inside(name: str, dest: Path) -> None:
    """Where the member would land, symlinks on disk resolved, is inside `dest` (data_filter's rule)."""
    root = os.path.realpath(dest)
    if os.path.commonpath([root, os.path.realpath(os.path.join(root, name))]) != root:
        raise BundleRefused("path", f"{name} would be written outside the install folder")


def _write_file(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path, sha256: str, size: int) -> int:
    source = tar.extractfile(member)
    if source is None:  # pragma: no cover - isreg() was checked
        raise BundleRefused("type", f"{member.name} has no data")
    digest = hashlib.sha256()
    count = 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out:
            while chunk := source.read(CHUNK):
                count += len(chunk)
                if count > size:
                    raise BundleRefused("size", f"{member.name} holds more than the {size} bytes declared")
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise BundleRefused("disk", f"disk full while writing {member.name}") from None
        if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP):
            raise BundleRefused(
                "duplicate", f"{member.name} clashes with another member: {exc.strerror}"
            ) from None
        raise
    if count != size:
        raise BundleRefused("truncated", f"{member.name} ends after {count} of {size} bytes")
    if digest.hexdigest() != sha256:
        raise BundleRefused(
            "hash", f"{member.name}: sha256 {digest.hexdigest()[:16]}... differs from the manifest"
        )
    return count


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, mtime
    tar.addfile(info, io.BytesIO(data))
