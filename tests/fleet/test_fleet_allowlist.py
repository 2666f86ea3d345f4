"""What a fleet command may change, checked without a broker: the set_config allowlist covers every
setting (allowed or refused with a reason), never lets through a listener, a credential, an access rule,
a path or the [fleet]/[ota] sections, is what the docs list, and filters a persisted overlay; the desired
state's generation is bounded; revoke_key's arguments are checked; wire text is made safe for logs."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from edgeserve.config import Settings
from edgeserve.config_allowlist import ALLOWED, REFUSED, refused_keys, why_refused
from edgeserve.fleet.desired import MAX_GENERATION, DesiredRefused, parse_desired
from edgeserve.fleet.protocol import CommandError, check_args
from edgeserve.logs import safe
from edgeserve.settings_tools import OVERLAY, load_layered

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- set_config allowlist -->"


def _all_settings() -> dict[str, Any]:
    """ "section.key" -> the field's type, for every setting there is."""
    out: dict[str, Any] = {}
    for section, section_type in get_type_hints(Settings).items():
        for name, kind in get_type_hints(section_type).items():
            out[f"{section}.{name}"] = kind
    return out


def test_every_setting_is_allowed_or_refused_with_a_reason() -> None:
    """A new setting must be classified here: unclassified ones are refused, but say why."""
    settings = _all_settings()
    assert set(ALLOWED) <= set(settings), set(ALLOWED) - set(settings)
    unclassified = [
        n for n in settings if n not in ALLOWED and n not in REFUSED and f"{n.split('.')[0]}.*" not in REFUSED
    ]
    assert not unclassified, f"classify these in edgeserve/config_allowlist.py: {unclassified}"
    assert not set(ALLOWED) & set(REFUSED)


def test_no_listener_credential_access_rule_path_or_local_section_is_allowed() -> None:
    for name, kind in _all_settings().items():
        section, key = name.split(".")
        never = (
            section in ("fleet", "ota")
            or key in ("host", "port", "enabled", "endpoints", "token", "admin_loopback_only", "file")
            or key.startswith("tls_")
            or "Path" in str(kind)
        )
        if never:
            assert why_refused(name) is not None, name


def test_refused_keys_are_all_named_and_escaped() -> None:
    refused = refused_keys(
        {"logging": {"level": "DEBUG", "file": "/x"}, "http": {"host": "0.0.0.0", "max_connections": 9},
         "grpc": {"admin_loopback_only": False}, "ota": {"trust_dir": "/tmp"}, "nosuch": {"a\nb": 1}}
    )  # fmt: skip
    assert refused == [
        "grpc.admin_loopback_only (access rule or restricted API)",
        "http.host (listener)",
        "logging.file (path)",
        "nosuch.a\\nb (not on the set_config allowlist)",
        "ota.trust_dir (the [ota] section (trust folder, bundle policy) is local only)",
    ]
    with pytest.raises(CommandError, match=r"http\.host.*nothing was applied"):
        check_args("set_config", {"http": {"host": "0.0.0.0"}})
    check_args("set_config", {"logging": {"level": "DEBUG"}, "server": {"load_models": ["a"]}})


def test_the_docs_list_the_allowlist() -> None:
    """The settings reference (generated, docs/reference/settings.md) lists exactly what a command may
    set, in its allowlist table and in the fleet column of every section's table."""
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert MARK in page, "docs/reference/settings.md lost its allowlist table: regenerate it"
    table = page.split(MARK, 1)[1].split("<!-- /set_config allowlist -->", 1)[0]
    assert set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", table, re.M)) == set(ALLOWED)
    row = re.compile(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \| `EDGESERVE_\w+` \| (?:live|restart) \| yes \|", re.M)
    marked = set()
    for block in page.split("\n## `[")[1:]:
        section = block.split("]", 1)[0]
        marked |= {f"{section}.{key}" for key in row.findall(block)}
    assert marked == set(ALLOWED)


def test_a_persisted_overlay_keeps_only_what_a_command_may_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An overlay an older version persisted after a hostile set_config: the listener, the admin rule
    and the log file in the trust folder are dropped at load, the log level stays."""
    state = tmp_path / "state"
    (state / OVERLAY).parent.mkdir(parents=True)
    (state / OVERLAY).write_text(
        '[http]\nhost = "0.0.0.0"\n[grpc]\nhost = "0.0.0.0"\nadmin_loopback_only = false\n'
        f'[logging]\nlevel = "DEBUG"\nfile = "{state}/trust/bundles/x.pub"\n'
    )
    with caplog.at_level(logging.WARNING, logger="edgeserve.fleet"):
        settings, sources = load_layered(None, environ={"EDGESERVE_SERVER_STATE_DIR": str(state)})
    assert settings.http.host == "127.0.0.1" and settings.grpc.host == "127.0.0.1"
    assert settings.grpc.admin_loopback_only is True and settings.logging.file is None
    assert settings.logging.level == "DEBUG" and sources["logging.level"] == str(state / OVERLAY)
    warning = next(r.getMessage() for r in caplog.records if "may not set" in r.getMessage())
    assert "http.host" in warning and "grpc.admin_loopback_only" in warning and "logging.file" in warning


@pytest.mark.parametrize("generation", [10**30, -1, "5", 1.5, True, None, 2**53])
def test_a_generation_outside_0_to_2_53_is_refused(generation: object) -> None:
    with pytest.raises(DesiredRefused, match="is not an integer from 0 to 9007199254740991"):
        parse_desired(json.dumps({"generation": generation}).encode())


def test_a_good_desired_state_and_its_bundle_checks() -> None:
    assert parse_desired(b"") is None  # the manager cleared it
    top = parse_desired(json.dumps({"generation": MAX_GENERATION}).encode())
    assert top is not None and top.generation == MAX_GENERATION and top.url is None
    ok = parse_desired(json.dumps({"generation": 3, "bundle": {"url": "https://fleet/b.esb"}}).encode())
    assert ok is not None and (ok.generation, ok.url, ok.sha256) == (3, "https://fleet/b.esb", None)
    for url in ("/var/lib/edgeserve/evil.esb", "https://x/\n-----BEGIN PUBLIC KEY-----", "ftp://x"):
        with pytest.raises(DesiredRefused, match=r"desired bundle: deploy_bundle args\.url"):
            parse_desired(json.dumps({"generation": 4, "bundle": {"url": url}}).encode())
    with pytest.raises(DesiredRefused, match="UTF-8 JSON"):
        parse_desired(b"\xff")
    with pytest.raises(DesiredRefused, match="JSON object"):
        parse_desired(b"[1]")


def test_revoke_key_arguments() -> None:
    check_args("revoke_key", {"key_id": "0123456789abcdef", "role": "bundle"})
    check_args("revoke_key", {"key_id": "0123456789abcdef", "role": "command"})
    for args, match in (
        ({"key_id": "0123456789ABCDEF", "role": "bundle"}, "16 lowercase hex"),
        ({"key_id": "0123", "role": "bundle"}, "16 lowercase hex"),
        ({"role": "bundle"}, "args.key_id"),
        ({"key_id": "0123456789abcdef", "role": "bundles"}, "role must be one of: bundle, command"),
        ({"key_id": "0123456789abcdef"}, "role must be one of"),
    ):
        with pytest.raises(CommandError, match=match):
            check_args("revoke_key", args)


def test_safe_escapes_control_characters_and_caps_the_length() -> None:
    assert safe("a\nb\r\x1b[31m\u202e\\") == "a\\nb\\r\\x1b[31m\\u202e\\\\"
    assert safe("déjà vu 'q' \"q\"") == "déjà vu 'q' \"q\""
    long = "x" * 500
    assert safe(long) == "x" * 120 + "…(500 chars)"
    capped = safe("\n" * 100, limit=10)
    assert capped == "\\n" * 5 + "…(100 chars)"
    assert safe(None) == "None" and safe(ValueError("bad\nline")) == "bad\\nline"


def test_a_host_named_manager_is_never_a_device() -> None:
    """es/v1/{fleet}/manager/... holds the fleet tools' inboxes: a device there could read their answers."""
    from unittest import mock

    from edgeserve.config import FleetSection
    from edgeserve.fleet.connection import device_id

    assert device_id(FleetSection(device_id="cam-1")) == "cam-1"
    with (
        mock.patch("socket.gethostname", return_value="manager.lan"),
        pytest.raises(ValueError, match="manager"),
    ):
        device_id(FleetSection())
