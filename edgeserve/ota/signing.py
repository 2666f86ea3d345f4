"""Ed25519 keys and signatures (`cryptography`): PEM PKCS#8 private keys, PEM SubjectPublicKeyInfo
public keys, key_id = the first 16 hex digits of sha256 over the raw 32-byte public key."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgeserve.ota.errors import BundleRefused

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

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
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an Ed25519 public key")
    return key


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    path: Path
    key: Ed25519PublicKey


def trusted_keys(trust_dir: Path) -> dict[str, TrustedKey]:
    """Every `*.pub` in the trust folder (several: key rotation); unreadable files are skipped."""
    keys: dict[str, TrustedKey] = {}
    if not trust_dir.is_dir():
        return keys
    for path in sorted(trust_dir.glob("*.pub")):
        try:
            public = load_public(path)
        except (OSError, ValueError):
            continue
        keys[key_id(public)] = TrustedKey(key_id(public), path, public)
    return keys


def verify(manifest_bytes: bytes, signature: bytes, declared_key_id: str, trust_dir: Path) -> TrustedKey:
    """The trusted key whose signature over the exact manifest bytes holds; refuses otherwise."""
    from cryptography.exceptions import InvalidSignature

    if len(signature) != SIGNATURE_BYTES:
        raise BundleRefused(
            "signature", f"manifest.sig is {len(signature)} bytes, not a 64-byte Ed25519 signature"
        )
    keys = trusted_keys(trust_dir)
    if not keys:
        raise BundleRefused(
            "signature", f"no trusted public key (*.pub) in {trust_dir}: every bundle is refused"
        )
    trusted = keys.get(declared_key_id)
    if trusted is None:
        raise BundleRefused(
            "signature", f"signed by unknown key {declared_key_id} (trusted: {', '.join(sorted(keys))})"
        )
    try:
        trusted.key.verify(signature, manifest_bytes)
    except InvalidSignature:
        raise BundleRefused(
            "signature", f"bad signature: manifest.json does not verify with key {declared_key_id}"
        ) from None
    return trusted
