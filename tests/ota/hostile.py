"""Craft hostile `.esb` bundles member by member, for the tests that check what a device refuses.

A bundle here is an explicit list of `Member`s written in order into a tar (optionally gzip): raw
`tarfile.TarInfo` headers of any type (symlink, hardlink, devices, FIFO, odd modes, absolute or ".."
names, duplicates, pax headers), so an attack is exactly what the list says. The manifest is a dict
turned into bytes by `edgeserve.ota.manifest.dump_manifest` and signed with the project's own
Ed25519 helpers (`edgeserve.ota.signing`); a signature can be valid, by another key, flipped,
garbage or missing.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

from edgeserve.ota.manifest import FORMAT, dump_manifest, rfc3339
from edgeserve.ota.signing import keygen, load_private

# How the manifest.sig member of a crafted bundle is made.
SIGNATURE_MODES = (
    "valid",  # the trusted signer over the exact manifest bytes
    "wrong-key",  # an untrusted key signs, the manifest still names the trusted key_id
    "unknown-key",  # an untrusted key signs and the manifest names that key
    "flipped-sig",  # a valid signature with one bit flipped
    "flipped-manifest",  # valid signature, then one bit of manifest.json flipped (still valid JSON)
    "garbage",  # 100 bytes that are no Ed25519 signature at all
    "missing",  # no manifest.sig member
)
INVALID_SIGNATURES = tuple(mode for mode in SIGNATURE_MODES if mode != "valid")


# ---------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class Signer:
    """An Ed25519 key pair written by `signing.keygen`."""

    private_path: Path
    public_path: Path
    key_id: str

    def sign(self, body: bytes) -> bytes:
        return load_private(self.private_path).sign(body)


def make_signer(folder: Path, name: str) -> Signer:
    private_path, public_path, key_id = keygen(folder, name)
    return Signer(private_path, public_path, key_id)


def make_trust_dir(trust_dir: Path, signers: Iterable[Signer]) -> Path:
    """A device's trust folder holding the public keys of `signers` (and nothing else)."""
    trust_dir.mkdir(parents=True, exist_ok=True)
    for signer in signers:
        shutil.copyfile(signer.public_path, trust_dir / f"{signer.key_id}.pub")
    return trust_dir


# ------------------------------------------------------------------------------------------- members
class ZeroStream(io.RawIOBase):
    """`size` zero bytes, produced on demand (a decompression bomb without holding it in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left)
        buffer[:count] = bytes(count)
        self.left -= count
        return count


@dataclass
class Member:
    """One tar member exactly as it goes into the archive: header, and data for regular files."""

    info: tarfile.TarInfo
    data: bytes | None = None
    stream_size: int | None = None  # data is ZeroStream(stream_size) instead of `data`

    def fileobj(self) -> IO[bytes] | None:
        if self.stream_size is not None:
            return io.BufferedReader(ZeroStream(self.stream_size))
        if self.data is not None:
            return io.BytesIO(self.data)
        return None


def _info(name: str, kind: bytes, mode: int, *, pax: dict[str, str] | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, 1_700_000_000
    info.uname = info.gname = "root"
    if pax:
        info.pax_headers = dict(pax)
    return info


def regular(name: str, data: bytes, *, mode: int = 0o644, pax: dict[str, str] | None = None) -> Member:
    """A regular file (pax records such as {"path": ...} or {"size": ...} override the ustar header)."""
    info = _info(name, tarfile.REGTYPE, mode, pax=pax)
    info.size = len(data)
    return Member(info, data)


def zeros(name: str, size: int, *, mode: int = 0o644) -> Member:
    """A regular file of `size` zero bytes, streamed (highly compressible)."""
    info = _info(name, tarfile.REGTYPE, mode)
    info.size = size
    return Member(info, stream_size=size)


def directory(name: str, *, mode: int = 0o755, pax: dict[str, str] | None = None) -> Member:
    return Member(_info(name, tarfile.DIRTYPE, mode, pax=pax))


def symlink(name: str, target: str) -> Member:
    info = _info(name, tarfile.SYMTYPE, 0o777)
    info.linkname = target
    return Member(info)


def hardlink(name: str, target: str) -> Member:
    info = _info(name, tarfile.LNKTYPE, 0o644)
    info.linkname = target
    return Member(info)


def chardev(name: str, major: int = 1, minor: int = 3) -> Member:  # /dev/null's numbers
    info = _info(name, tarfile.CHRTYPE, 0o666)
    info.devmajor, info.devminor = major, minor
    return Member(info)


def blockdev(name: str, major: int = 8, minor: int = 0) -> Member:  # /dev/sda's numbers
    info = _info(name, tarfile.BLKTYPE, 0o660)
    info.devmajor, info.devminor = major, minor
    return Member(info)


def fifo(name: str) -> Member:
    return Member(_info(name, tarfile.FIFOTYPE, 0o644))


def raw_member(info: tarfile.TarInfo, data: bytes | None = None) -> Member:
    """Any TarInfo as built by the caller (unknown types, odd fields); `data` for types with data."""
    return Member(info, data)


# ------------------------------------------------------------------------------------------ manifest
def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(
    path: str, data: bytes, *, size: int | None = None, digest: str | None = None
) -> dict[str, Any]:
    """The manifest's record of a file; `size`/`digest` lie about `data` when given."""
    return {"path": path, "sha256": digest or sha256(data), "size": len(data) if size is None else size}


def manifest_for(
    files: Sequence[tuple[str, bytes] | dict[str, Any]],
    *,
    key_id: str,
    now: datetime,
    name: str = "demo",
    version: int = 1,
    models: dict[str, list[int]] | None = None,
    arch: Sequence[str] = ("x86_64", "aarch64"),
    accelerators: Sequence[str] | None = None,
    min_edgeserve: str = "0.1.0",
    created_at: datetime | None = None,
    expires_at: datetime | None = None,
    unpacked_size: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A format-1 manifest dict; every field can be made to lie (sizes, sums, times, paths)."""
    entries = [f if isinstance(f, dict) else file_entry(*f) for f in files]
    if models is None:
        models = {}
        for entry in entries:
            parts = PurePosixPath(entry["path"]).parts
            if len(parts) >= 3 and parts[0] == "models":
                version_dir = parts[2]
                models.setdefault(parts[1], [])
                number = int(version_dir) if version_dir.isdigit() and int(version_dir) > 0 else 1
                if number not in models[parts[1]]:
                    models[parts[1]].append(number)
        models = models or {"m": [1]}
    compatible: dict[str, Any] = {"arch": list(arch), "min_edgeserve": min_edgeserve}
    if accelerators is not None:
        compatible["accelerators"] = list(accelerators)
    data: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "version": version,
        "created_at": rfc3339(created_at or now - timedelta(hours=1)),
        "expires_at": rfc3339(expires_at or now + timedelta(days=30)),
        "compatible": compatible,
        "models": models,
        "files": entries,
        "unpacked_size": sum(e["size"] for e in entries) if unpacked_size is None else unpacked_size,
        "key_id": key_id,
    }
    data.update(extra)
    return data


def flip_bit(data: bytes, index: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[index] ^= 1 << bit
    return bytes(out)


def flip_manifest_bit(body: bytes) -> bytes:
    """One bit of the bundle name flipped: valid JSON, same key_id, no longer the signed bytes."""
    index = body.index(b'"name":"') + len(b'"name":"')
    return flip_bit(body, index)


def signed_header(
    manifest: dict[str, Any] | bytes,
    signer: Signer,
    mode: str = "valid",
    *,
    intruder: Signer | None = None,
) -> list[Member]:
    """The first members: manifest.json (dump_manifest bytes) and manifest.sig as `mode` says."""
    if mode not in SIGNATURE_MODES:
        raise ValueError(f"unknown signature mode {mode!r}")
    if mode in ("wrong-key", "unknown-key") and intruder is None:
        raise ValueError(f"signature mode {mode} needs an intruder key")
    if mode == "unknown-key":
        assert intruder is not None and isinstance(manifest, dict)
        manifest = {**manifest, "key_id": intruder.key_id}
    body = manifest if isinstance(manifest, bytes) else dump_manifest(manifest)
    signature: bytes | None
    if mode == "valid":
        signature = signer.sign(body)
    elif mode in ("wrong-key", "unknown-key"):
        assert intruder is not None
        signature = intruder.sign(body)
    elif mode == "flipped-sig":
        signature = flip_bit(signer.sign(body), 10, 3)
    elif mode == "flipped-manifest":
        signature = signer.sign(body)
        body = flip_manifest_bit(body)
    elif mode == "garbage":
        signature = bytes(range(100))
    else:  # missing
        signature = None
    members = [regular("manifest.json", body)]
    if signature is not None:
        members.append(regular("manifest.sig", signature))
    return members


# ------------------------------------------------------------------------------------------- writing
def write_bundle(
    path: Path,
    members: Sequence[Member],
    *,
    compress: bool = True,
    tar_format: int = tarfile.PAX_FORMAT,
    compresslevel: int = 6,
) -> Path:
    """Write exactly `members`, in order, as a tar (gzip when `compress`); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw:
        stream = cast(
            "IO[bytes]",
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=compresslevel) if compress else raw,
        )
        with tarfile.open(fileobj=stream, mode="w", format=tar_format) as tar:
            for member in members:
                tar.addfile(member.info, member.fileobj())
        if stream is not raw:
            stream.close()
    return path


@dataclass
class Bundle:
    """A convenience: a manifest, its signature mode and the members after the header."""

    manifest: dict[str, Any]
    members: list[Member] = field(default_factory=list)

    def write(
        self,
        path: Path,
        signer: Signer,
        mode: str = "valid",
        *,
        intruder: Signer | None = None,
        compress: bool = True,
        tar_format: int = tarfile.PAX_FORMAT,
    ) -> Path:
        header = signed_header(self.manifest, signer, mode, intruder=intruder)
        return write_bundle(path, [*header, *self.members], compress=compress, tar_format=tar_format)


def truncate(source: Path, dest: Path, length: int) -> Path:
    """A download cut after `length` bytes."""
    dest.write_bytes(source.read_bytes()[:length])
    return dest


def tar_data_offset(path: Path, name: str) -> int:
    """Where member `name`'s data starts in an uncompressed bundle."""
    with tarfile.open(path, "r:") as tar:
        return tar.getmember(name).offset_data
