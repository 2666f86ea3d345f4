"""Ed25519 keys and signatures (`cryptography`): PEM PKCS#8 private keys, PEM SubjectPublicKeyInfo
public keys, key_id = the first 16 hex digits of sha256 over the raw 32-byte public key."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgeserve.logs import safe
from edgeserve.ota.errors import BundleRefused

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger("edgeserve.ota")

SIGNATURE_BYTES = 64


def key_id(public: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def keygen(out: Path, name: str = "edgeserve") -> tuple[Path, Path, str]:
    """Write `out/name.key` (0600) and `out/name.pub`; refuses to overwrite a key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    out.mkdir(parents=True, exist_ok=True)
    private_path, public_path = out / f"{name}.key", out / f"{name}.pub"
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never a world-readable moment
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public = private.public_key()
    public_path.write_bytes(
        public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private_path, public_path, key_id(public)


def load_private(path: Path) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    """The key of a trust file: exactly one PEM Ed25519 public key (see `parse_public`)."""
    return parse_public(read_key_file(path))


MAX_KEY_FILE_BYTES = 4096  # one Ed25519 PEM is 113 bytes
# Exactly one "PUBLIC KEY" PEM block, whitespace around it and nothing else: a file that merely
# contains a key (a log line into which a key was smuggled, a note with a key pasted in) is no key.
_PEM = re.compile(
    rb"\A\s*(-----BEGIN PUBLIC KEY-----\r?\n"
    rb"(?:[A-Za-z0-9+/]{1,76}={0,2}\r?\n){1,4}"
    rb"-----END PUBLIC KEY-----)\s*\Z"
)


def read_key_file(path: Path) -> bytes:
    """The bytes of a trust file (a regular file, small); ValueError says why not."""
    if not path.is_file():  # a FIFO or a device would block or never end
        raise ValueError("not a regular file")
    with open(path, "rb") as fh:
        data = fh.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"over {MAX_KEY_FILE_BYTES} bytes: not one public key")
    return data


def parse_public(data: bytes) -> Ed25519PublicKey:
    """Exactly one PEM SubjectPublicKeyInfo Ed25519 key, as `keygen` writes it; ValueError says why not."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    match = _PEM.match(data)
    if match is None:
        raise ValueError("not exactly one PEM public key (only whitespace may surround it)")
    try:
        key = serialization.load_pem_public_key(match.group(1))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"unreadable PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"a {type(key).__name__.lstrip('_')}, not an Ed25519 public key")
    return key


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    path: Path
    key: Ed25519PublicKey


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A trust problem is logged once per process, not at every verification or `info`."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def key_folder(trust_dir: Path) -> Path:
    """Where the bundle keys are: `<trust_dir>/bundles/` when it exists, else the folder itself (a plain
    folder of keys, as `edgeserve bundle verify --trust` takes, or a device's pre-0.x flat layout)."""
    bundles = trust_dir / "bundles"
    return bundles if bundles.is_dir() else trust_dir


def trusted_keys(folder: Path, role: str = "bundle") -> dict[str, TrustedKey]:
    """Every valid `*.pub` in `folder` (several: key rotation). A file that is not exactly one PEM
    Ed25519 public key is skipped with a warning."""
    keys: dict[str, TrustedKey] = {}
    if not folder.is_dir():
        return keys
    for path in sorted(folder.glob("*.pub")):
        try:
            public = load_public(path)
        except (OSError, ValueError) as exc:
            warn_once(f"{role} key file {safe(path, 200)} ignored: {safe(exc, 200)}")
            continue
        keys[key_id(public)] = TrustedKey(key_id(public), path, public)
    return keys


def verify(
    manifest_bytes: bytes,
    signature: bytes,
    declared_key_id: str,
    trust_dir: Path,
    revoked: Mapping[str, str] | None = None,
) -> TrustedKey:
    """The trusted key whose signature over the exact manifest bytes holds; refuses otherwise.
    `revoked`: key id -> why it is no longer trusted (refused even while its file is still there)."""
    from cryptography.exceptions import InvalidSignature

    if len(signature) != SIGNATURE_BYTES:
        raise BundleRefused(
            "signature", f"manifest.sig is {len(signature)} bytes, not a 64-byte Ed25519 signature"
        )
    if revoked and declared_key_id in revoked:
        raise BundleRefused(
            "revoked", f"signed by revoked key {declared_key_id} ({revoked[declared_key_id]})"
        )
    folder = key_folder(trust_dir)
    keys = trusted_keys(folder)
    if not keys:
        raise BundleRefused(
            "signature", f"no trusted public key (*.pub) in {folder}: every bundle is refused"
        )
    trusted = keys.get(declared_key_id)
    if trusted is None:
        raise BundleRefused(
            "signature",
            f"signed by unknown key {safe(declared_key_id, 40)} (trusted: {', '.join(sorted(keys))})",
        )
    try:
        trusted.key.verify(signature, manifest_bytes)
    except InvalidSignature:
        raise BundleRefused(
            "signature", f"bad signature: manifest.json does not verify with key {declared_key_id}"
        ) from None
    return trusted
