"""The signed command envelope (edgeserve/fleet/signed.py) byte for byte, the trusted command keys folder,
the [fleet] signing settings, `edgeserve keygen --role command` and the log-escaping helper. The attacks
against a running device are in tests/security/test_fleet_commands.py."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_keys import COMMAND_KEY, OTHER_KEY, public_pem, trust, trusted

from edgeserve.cli import main as edgeserve_main
from edgeserve.config import ConfigError, load_settings
from edgeserve.fleet.protocol import CommandError, utc
from edgeserve.fleet.signed import (
    CommandKeys,
    load_command_keys,
    open_command,
    open_envelope,
    peek_cmd_id,
    sign_command,
)
from edgeserve.logs import safe

TOPIC = "es/v1/plant-7/cam-01/cmd/rollback"
NOW = datetime(2026, 11, 24, 3, 0, tzinfo=timezone.utc)


def command(lifetime_s: float = 60, issued: datetime = NOW, cmd_id: str = "c-1") -> str:
    expires = issued + timedelta(seconds=lifetime_s)
    return json.dumps({"cmd_id": cmd_id, "issued_at": utc(issued), "expires_at": utc(expires),
                       "args": {"to_version": 3}})  # fmt: skip


def test_the_wire_form_is_the_fixed_format() -> None:
    text = command()
    envelope = json.loads(sign_command(COMMAND_KEY, TOPIC, text))
    assert list(envelope) == ["v", "key_id", "sig", "command"] and envelope["v"] == 1
    raw = COMMAND_KEY.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert envelope["key_id"] == hashlib.sha256(raw).hexdigest()[:16]
    assert envelope["command"] == text
    signature = base64.b64decode(envelope["sig"])
    assert len(signature) == 64
    # Verified by hand, without edgeserve's code: the domain, the topic and the text, newline separated.
    COMMAND_KEY.public_key().verify(
        signature, b"edgeserve-command-v1\n" + TOPIC.encode() + b"\n" + text.encode()
    )


def test_open_verifies_and_binds_the_topic() -> None:
    payload = sign_command(COMMAND_KEY, TOPIC, command())
    opened = open_command(TOPIC, payload, trusted(), NOW, 86400)
    assert (opened.cmd_id, opened.verb, opened.args) == ("c-1", "rollback", {"to_version": 3})
    for other in ("es/v1/plant-7/cam-02/cmd/rollback", "es/v1/plant-7/cam-01/cmd/restart_runtime"):
        with pytest.raises(CommandError, match="bad signature"):
            open_envelope(other, payload, trusted())
    with pytest.raises(CommandError, match="not a trusted command key"):
        open_envelope(TOPIC, sign_command(OTHER_KEY, TOPIC, command()), trusted())
    with pytest.raises(CommandError, match="no trusted command key"):
        open_envelope(TOPIC, payload, {})
    # The text is signed as it is (no re-serialisation): non-ASCII and odd spacing survive the envelope.
    odd = json.dumps({"cmd_id": "c-2", "args": {"note": "caf\u00e9 \u2028"}}, ensure_ascii=False) + " \n"
    assert open_envelope(TOPIC, sign_command(COMMAND_KEY, TOPIC, odd), trusted()).text == odd


def test_lifetime_and_clock_checks() -> None:
    ok = sign_command(COMMAND_KEY, TOPIC, command(lifetime_s=86400))
    assert open_command(TOPIC, ok, trusted(), NOW, 86400).cmd_id == "c-1"
    long = sign_command(COMMAND_KEY, TOPIC, command(lifetime_s=86401))
    with pytest.raises(CommandError, match=r"lifetime of 86401 s .* limit of 86400 s"):
        open_command(TOPIC, long, trusted(), NOW, 86400)
    ahead = sign_command(COMMAND_KEY, TOPIC, command(issued=NOW + timedelta(days=3650)))
    with pytest.raises(CommandError, match="in the future"):
        open_command(TOPIC, ahead, trusted(), NOW, 86400)
    skewed = sign_command(COMMAND_KEY, TOPIC, command(issued=NOW + timedelta(seconds=200)))
    assert open_command(TOPIC, skewed, trusted(), NOW, 86400).cmd_id == "c-1"  # within the clock skew
    with pytest.raises(CommandError, match="expired"):
        open_command(TOPIC, ok, trusted(), NOW + timedelta(days=2), 86400)


def test_peek_cmd_id_reads_plain_and_enveloped_commands_only() -> None:
    assert peek_cmd_id(sign_command(COMMAND_KEY, TOPIC, command())) == "c-1"
    assert peek_cmd_id(command().encode()) == "c-1"
    assert peek_cmd_id(b"[" * 50_000) is None and peek_cmd_id(b"\xff") is None and peek_cmd_id(b"[1]") is None


def test_command_keys_folder_takes_only_single_pem_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = trust(tmp_path / "keys")
    (folder / "two.pub").write_bytes(public_pem(OTHER_KEY) + public_pem(OTHER_KEY))
    (folder / "junk.pub").write_bytes(b"# a comment\n" + public_pem(OTHER_KEY))
    private = OTHER_KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (folder / "private.pub").write_bytes(private)
    (folder / "huge.pub").write_bytes(public_pem(OTHER_KEY) + b" " * 8192)
    rsa_like = (
        b"-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(os.urandom(48)) + b"\n-----END PUBLIC KEY-----\n"
    )
    (folder / "notakey.pub").write_bytes(rsa_like)
    (folder / "other.txt").write_bytes(public_pem(OTHER_KEY))  # not *.pub: not read at all
    keys, warnings = load_command_keys(folder)
    assert list(keys) == list(trusted())
    ignored = sorted(w.split(" ignored")[0].rsplit("/", 1)[-1] for w in warnings)
    assert ignored == ["huge.pub", "junk.pub", "notakey.pub", "private.pub", "two.pub"]
    assert load_command_keys(tmp_path / "missing") == ({}, [])
    # The live view: warns once per change, sees a new key without a restart.
    live = CommandKeys(folder)
    with caplog.at_level(logging.WARNING, "edgeserve.fleet"):
        live.current()
        live.current()
    assert len([r for r in caplog.records if "two.pub ignored" in r.getMessage()]) == 1
    trust(folder, OTHER_KEY, "rotated")
    assert len(live.current()) == 2


def test_safe_escapes_and_caps() -> None:
    assert safe("cmd-1") == "cmd-1"
    assert safe("a\nb\x1b[2J\u202e") == "a\\nb\\x1b[2J\\u202e"
    long = safe("x" * 10_000)
    assert long.endswith("…(10000 chars)") and len(long) < 150
    escapes = safe("\x00" * 500, limit=50)
    assert "\x00" not in escapes and len(escapes) < 80 and escapes.endswith("(500 chars)")
    assert safe(b"\xffok") == "\\\\xffok" and safe(None) == "None"


def test_fleet_signing_settings_are_validated(tmp_path: Path) -> None:
    defaults = load_settings(environ={}).fleet
    assert (defaults.command_keys, defaults.require_signed_commands) == (None, True)
    assert defaults.max_command_lifetime_s == 86400
    config = tmp_path / "edgeserve.toml"
    config.write_text("[fleet]\nmax_command_lifetime_s = 0\n")
    with pytest.raises(
        ConfigError, match=r"edgeserve\.toml: fleet\.max_command_lifetime_s: must be more than 0"
    ):
        load_settings(config, environ={})
    config.write_text(f"[fleet]\nmax_command_lifetime_s = {31 * 86400}\n")
    with pytest.raises(ConfigError, match="at most 2592000 seconds"):
        load_settings(config, environ={})
    config.write_text(f'[fleet]\ncommand_keys = "{config}"\n')
    with pytest.raises(ConfigError, match=r"fleet\.command_keys: .* is a file; give the folder"):
        load_settings(config, environ={})
    env = {"EDGESERVE_FLEET_REQUIRE_SIGNED_COMMANDS": "false", "EDGESERVE_FLEET_COMMAND_KEYS": str(tmp_path)}
    fleet = load_settings(environ=env).fleet
    assert fleet.require_signed_commands is False and fleet.command_keys == tmp_path


def test_keygen_role_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert edgeserve_main(["keygen", "--out", str(tmp_path), "--role", "command"]) == 0
    out = capsys.readouterr().out
    assert "edgeserve-commands.pub (copy to the [fleet] command_keys folder" in out and "role: command" in out
    keys, warnings = load_command_keys(tmp_path)
    assert len(keys) == 1 and warnings == [] and next(iter(keys)) in out
    assert (tmp_path / "edgeserve-commands.key").stat().st_mode & 0o077 == 0
    assert edgeserve_main(["keygen", "--out", str(tmp_path), "--role", "command"]) == 1  # never overwrites
    assert isinstance(
        serialization.load_pem_private_key((tmp_path / "edgeserve-commands.key").read_bytes(), None),
        Ed25519PrivateKey,
    )
