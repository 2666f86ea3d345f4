"""Signed fleet commands: the envelope fixed in OTA.md "Signed commands", used by the device agent and
the fleet tools alike, so that both agree byte for byte.

    {"v": 1, "key_id": "<16 hex>", "sig": "<base64, 64 bytes>", "command": "<the command's JSON text>"}

The signature is Ed25519 over b"edgeserve-command-v1\\n" + topic + b"\\n" + command (UTF-8), topic being
the full MQTT topic the sender publishes to: the same envelope on another device's or another verb's
topic does not verify. key_id is the bundle keys' (sha256 of the raw public key, 16 hex digits), but the
trusted command keys are a folder of their own: a bundle key cannot sign commands.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.fleet.jsonlimits import JsonRefused, loads
from edgeserve.fleet.protocol import MAX_PAYLOAD_BYTES, Command, CommandError, parse_command, utc
from edgeserve.logs import safe
from edgeserve.ota.signing import (
    SIGNATURE_BYTES,
    TrustedKey,
    key_id,
    load_private,
    parse_public,
    read_key_file,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = logging.getLogger("edgeserve.fleet")

VERSION = 1
DOMAIN = b"edgeserve-command-v1\n"
FIELDS = frozenset({"v", "key_id", "sig", "command"})
CLOCK_SKEW_S = 300  # issued_at may be this far ahead of the device's clock (NTP not yet synced)
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")


def signed_bytes(topic: str, command_text: str) -> bytes:
    return DOMAIN + topic.encode("utf-8") + b"\n" + command_text.encode("utf-8")


def sign_command(private_key: Ed25519PrivateKey, topic: str, command_text: str) -> bytes:
    """The envelope (UTF-8 JSON) that carries `command_text` to `topic`, signed by `private_key`."""
    signature = private_key.sign(signed_bytes(topic, command_text))
    envelope = {
        "v": VERSION,
        "key_id": key_id(private_key.public_key()),
        "sig": base64.b64encode(signature).decode("ascii"),
        "command": command_text,
    }
    return json.dumps(envelope).encode("utf-8")


def load_signing_key(key: Ed25519PrivateKey | str | Path | None) -> Ed25519PrivateKey | None:
    """A private command key, given as itself or as the path of its PEM file; ValueError says why not."""
    if not isinstance(key, (str, Path)):
        return key
    try:
        return load_private(Path(key))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"command key {key}: {getattr(exc, 'strerror', None) or exc}") from None


def is_envelope(body: Any) -> bool:
    """A payload that claims to be signed (checked strictly), as opposed to a plain unsigned command."""
    return isinstance(body, dict) and bool(FIELDS & set(body))


@dataclass(frozen=True)
class Opened:
    key_id: str
    text: str  # the command (or desired state) exactly as signed


def open_envelope(topic: str, payload: bytes, keys: Mapping[str, TrustedKey]) -> Opened:
    """The verified command text of an envelope published on `topic`; CommandError says why not."""
    from cryptography.exceptions import InvalidSignature

    if len(payload) > MAX_PAYLOAD_BYTES:
        raise CommandError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    try:
        body = loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
    except JsonRefused as exc:
        raise CommandError(f"malformed signed command: not UTF-8 JSON within limits: {exc}") from None
    if not isinstance(body, dict) or set(body) != FIELDS:
        fields = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise CommandError(
            f"malformed signed command: fields {safe(fields)}, expected v, key_id, sig, command"
        )
    if type(body["v"]) is not int or body["v"] != VERSION:
        raise CommandError(
            f"malformed signed command: envelope version {safe(body['v'], 20)}, this device knows 1"
        )
    declared, text, sig = body["key_id"], body["command"], body["sig"]
    if not isinstance(declared, str) or not _KEY_ID.match(declared):
        raise CommandError("malformed signed command: key_id is not 16 lowercase hex digits")
    if not isinstance(text, str):
        raise CommandError("malformed signed command: command is not a string (the signed JSON text)")
    try:
        if not isinstance(sig, str):
            raise ValueError(sig)
        signature = base64.b64decode(sig, validate=True)
        message = signed_bytes(topic, text)
    except (binascii.Error, ValueError):  # a lone surrogate in the text cannot be UTF-8 either
        raise CommandError("malformed signed command: sig is not base64, or command is not UTF-8") from None
    if len(signature) != SIGNATURE_BYTES:
        raise CommandError(f"malformed signed command: sig is {len(signature)} bytes, not 64")
    if not keys:
        raise CommandError(f"no trusted command key on this device: key {declared} refused")
    trusted = keys.get(declared)
    if trusted is None:
        raise CommandError(f"signed by key {declared}, which is not a trusted command key of this device")
    try:
        trusted.key.verify(signature, message)
    except InvalidSignature:
        raise CommandError(
            f"bad signature: the command does not verify with key {declared} on topic {topic} "
            "(altered, or signed for another device or verb)"
        ) from None
    return Opened(declared, text)


def check_lifetime(command: Command, now: datetime, max_lifetime_s: float) -> None:
    """No command outlives the device's limit, however far its sender set expires_at."""
    lifetime = (command.expires_at - command.issued_at).total_seconds()
    if lifetime > max_lifetime_s:
        raise CommandError(
            f"lifetime of {lifetime:.0f} s (issued_at to expires_at) is over this device's limit of "
            f"{max_lifetime_s:.0f} s ([fleet] max_command_lifetime_s)"
        )
    if command.issued_at > now + timedelta(seconds=CLOCK_SKEW_S):
        raise CommandError(
            f"issued_at {utc(command.issued_at)} is in the future (the device's clock says {utc(now)})"
        )


def open_command(
    topic: str, payload: bytes, keys: Mapping[str, TrustedKey], now: datetime, max_lifetime_s: float
) -> Command:
    """A signed command published on `topic` (…/cmd/{verb}): verified, parsed, within its lifetime."""
    text = open_envelope(topic, payload, keys).text
    command = parse_command(topic.rsplit("/", 1)[-1], text.encode("utf-8"), now)
    check_lifetime(command, now, max_lifetime_s)
    return command


def peek_cmd_id(payload: bytes) -> object:
    """The cmd_id a payload (an envelope's command text, or a plain command) names, unverified: only to
    address a refusal and to log it (escaped)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        return None
    try:
        body = loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
        if is_envelope(body) and isinstance(body.get("command"), str):
            body = loads(body["command"], max_bytes=MAX_PAYLOAD_BYTES)
    except JsonRefused:
        return None
    return body.get("cmd_id") if isinstance(body, dict) else None


def load_command_keys(
    folder: Path, revoked: frozenset[str] = frozenset()
) -> tuple[dict[str, TrustedKey], list[str]]:
    """The trusted command keys in `folder` (every `*.pub` holding exactly one PEM public key, as
    `edgeserve keygen --role command` writes it, read by the trust store's one parser) less the `revoked`
    key ids, and one warning per file that was ignored."""
    keys: dict[str, TrustedKey] = {}
    warnings: list[str] = []
    if not folder.is_dir():
        return keys, warnings
    for path in sorted(folder.glob("*.pub")):
        try:
            public = parse_public(read_key_file(path))
        except (OSError, ValueError) as exc:
            warnings.append(f"command key {safe(path, 200)} ignored: {safe(exc, 200)}")
            continue
        kid = key_id(public)
        if kid in revoked:
            warnings.append(f"command key {safe(path, 200)} ignored: key id {kid} was revoked by the fleet")
            continue
        keys[kid] = TrustedKey(kid, path, public)
    return keys, warnings


class CommandKeys:
    """The trusted command keys of a folder, read again when its `*.pub` files change (a rotation needs
    no restart); each ignored file is warned about once per change."""

    def __init__(self, folder: Path, revoked: Callable[[], frozenset[str] | None] = frozenset) -> None:
        self.folder = folder
        self._revoked = revoked
        self._stamp: object = None
        self._keys: dict[str, TrustedKey] = {}

    def current(self) -> dict[str, TrustedKey]:
        revoked = self._revoked()
        if revoked is None:  # the revocation list is unreadable: fail closed
            self._stamp = None
            return {}
        stamp = (self._listing(), revoked)
        if stamp != self._stamp:
            self._keys, warnings = load_command_keys(self.folder, revoked)
            for warning in warnings:
                log.warning("fleet: %s", warning)
            self._stamp = stamp
        return self._keys

    def _listing(self) -> object:
        try:
            return tuple(
                (p.name, s.st_mtime_ns, s.st_size, s.st_ino)
                for p in sorted(self.folder.glob("*.pub"))
                for s in (p.stat(),)
            )
        except OSError:
            return None
