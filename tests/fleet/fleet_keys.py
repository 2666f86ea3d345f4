"""Command keys for the fleet tests. Fixed (derived from a constant), so that every process of a test run
signs and trusts the same keys; they sign nothing outside the tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgeserve.ota.signing import TrustedKey, key_id


def _key(label: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label.encode()).digest())


COMMAND_KEY = _key("edgeserve tests: the fleet's command key")
OTHER_KEY = _key("edgeserve tests: a key no device trusts")


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def trust(folder: Path, key: Ed25519PrivateKey = COMMAND_KEY, name: str = "test-commands") -> Path:
    """Put `key`'s public half in a device's command_keys folder (as `edgeserve keygen` writes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.pub").write_bytes(public_pem(key))
    return folder


def trusted(key: Ed25519PrivateKey = COMMAND_KEY) -> dict[str, TrustedKey]:
    """The in-memory trusted-key map a device builds from a folder that holds `key`'s .pub."""
    public = key.public_key()
    return {key_id(public): TrustedKey(key_id(public), Path("test-commands.pub"), public)}


def write_private(path: Path, key: Ed25519PrivateKey = COMMAND_KEY) -> Path:
    """The private key as a PEM file (0600), for `edgeserve fleet ... --key PATH`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return path
