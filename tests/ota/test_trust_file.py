"""The trust store's parts on their own: a trust file is exactly one PEM Ed25519 public key, the key
folders keep their roles, the old flat layout still reads (bundle keys only), revocations persist and
fail closed, and a log file is never allowed inside the trust folder."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from edgeserve.config import Settings
from edgeserve.ota import signing
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.trust import TrustStore, log_file_problem, trust_dir_for


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    signing._warned.clear()  # each test sees its own warnings (they are logged once per process)


def _pem(public: ed25519.Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _signer() -> tuple[ed25519.Ed25519PrivateKey, bytes, str]:
    private = ed25519.Ed25519PrivateKey.generate()
    return private, _pem(private.public_key()), signing.key_id(private.public_key())


def test_keygen_output_is_a_trust_file(tmp_path: Path) -> None:
    _, public, kid = signing.keygen(tmp_path, "fleet")
    assert signing.key_id(signing.load_public(public)) == kid


def test_whitespace_around_the_key_and_crlf_are_fine() -> None:
    _, pem, kid = _signer()
    key = signing.parse_public(b"\n \t" + pem.replace(b"\n", b"\r\n") + b"\n\n")
    assert signing.key_id(key) == kid


@pytest.mark.parametrize(
    "wrap",
    [
        lambda pem: b"2025-01-01 INFO edgeserve.fleet: fleet command " + pem,  # a log line before it
        lambda pem: pem + b" on get_status rejected: cmd_id must be ...\n",  # text after it
        lambda pem: b"note: " + pem + b"end\n",
        lambda pem: pem + pem,  # two keys in one file
        lambda pem: pem.replace(b"\n", b" | ", 1),  # a one-line log formatter's rendering
        lambda pem: pem.replace(b"-----\n", b"-----\\n"),  # escaped as a log would escape it
        lambda pem: b"# comment\n" + pem,
    ],
    ids=["log-before", "text-after", "both", "two-keys", "one-line-log", "escaped", "comment"],
)
def test_a_key_inside_other_text_is_no_key(wrap: object) -> None:
    _, pem, _ = _signer()
    with pytest.raises(ValueError, match="not exactly one PEM public key"):
        signing.parse_public(wrap(pem))  # type: ignore[operator]


def test_other_key_kinds_and_private_keys_are_refused() -> None:
    ec_public = ec.generate_private_key(ec.SECP256R1()).public_key()
    ec_pem = ec_public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        signing.parse_public(ec_pem)
    private = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(ValueError, match="not exactly one PEM public key"):
        signing.parse_public(private)
    bogus = b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
    with pytest.raises(ValueError, match="unreadable PEM public key"):
        signing.parse_public(bogus)


def test_oversized_files_and_fifos_are_refused_without_reading_them_whole(tmp_path: Path) -> None:
    _, pem, _ = _signer()
    big = tmp_path / "big.pub"
    big.write_bytes(pem + b" " * signing.MAX_KEY_FILE_BYTES)
    with pytest.raises(ValueError, match="over 4096 bytes"):
        signing.load_public(big)
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)  # opening it for reading would block forever
    with pytest.raises(ValueError, match="not a regular file"):
        signing.load_public(fifo)


def test_a_folder_skips_bad_files_with_an_escaped_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, pem, kid = _signer()
    _, other, _ = _signer()
    (tmp_path / "good.pub").write_bytes(pem)
    evil_name = tmp_path / "evil\nINFO forged line.pub"
    evil_name.write_bytes(b"log text " + other)
    with caplog.at_level(logging.WARNING, logger="edgeserve.ota"):
        keys = signing.trusted_keys(tmp_path)
    assert list(keys) == [kid]
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "evil\\nINFO forged line.pub" in warnings[0] and "not exactly one PEM public key" in warnings[0]


def _sign(private: ed25519.Ed25519PrivateKey, kid: str) -> tuple[bytes, bytes]:
    body = json.dumps({"name": "vision", "version": 1, "key_id": kid}).encode()
    return body, private.sign(body)


def test_bundle_keys_come_from_bundles_not_commands(tmp_path: Path) -> None:
    trust, state = tmp_path / "trust", tmp_path / "state"
    bundle_key, bundle_pem, bundle_id = _signer()
    command_key, command_pem, command_id = _signer()
    (trust / "bundles").mkdir(parents=True)
    (trust / "commands").mkdir()
    (trust / "bundles" / "b.pub").write_bytes(bundle_pem)
    (trust / "commands" / "c.pub").write_bytes(command_pem)
    store = TrustStore(trust, state)
    assert store.verify_bundle(*_sign(bundle_key, bundle_id), bundle_id).key_id == bundle_id
    with pytest.raises(BundleRefused, match=f"unknown key {command_id}"):
        store.verify_bundle(*_sign(command_key, command_id), command_id)
    assert list(store.keys_of("command")) == [command_id]


def test_the_old_flat_layout_reads_as_bundle_keys_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trust = tmp_path / "state" / "trust"
    trust.mkdir(parents=True)
    key, pem, kid = _signer()
    (trust / "fleet.pub").write_bytes(pem)
    store = TrustStore(trust, tmp_path / "state")
    with caplog.at_level(logging.WARNING, logger="edgeserve.ota"):
        assert store.verify_bundle(*_sign(key, kid), kid).key_id == kid
    assert any("deprecated layout" in r.getMessage() for r in caplog.records)
    assert store.keys_of("command") == {}  # never a command key
    # Once bundles/ exists, keys left beside it are ignored (and said so).
    (trust / "bundles").mkdir()
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="edgeserve.ota"),
        pytest.raises(BundleRefused, match="no trusted"),
    ):
        store.verify_bundle(*_sign(key, kid), kid)
    assert any("fleet.pub" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)


def test_revocation_persists_holds_with_the_file_present_and_is_idempotent(tmp_path: Path) -> None:
    trust, state = tmp_path / "trust", tmp_path / "state"
    (trust / "bundles").mkdir(parents=True)
    key, pem, kid = _signer()
    (trust / "bundles" / "fleet.pub").write_bytes(pem)
    first = TrustStore(trust, state).revoke(kid, "bundle", "fleet command c-1")
    assert first == {"key_id": kid, "role": "bundle", "revoked": True, "already": False, "known_here": True}
    again = TrustStore(trust, state)  # a new process: what is on disk counts
    assert again.revoke(kid, "bundle", "fleet command c-2")["already"] is True
    assert again.revoked("bundle")[kid]["by"] == "fleet command c-1"
    with pytest.raises(BundleRefused, match=f"revoked key {kid}.*c-1") as refused:
        again.verify_bundle(*_sign(key, kid), kid)
    assert refused.value.reason == "revoked"
    assert again.revoked("command") == {}


def test_an_unreadable_revocation_list_refuses_every_bundle(tmp_path: Path) -> None:
    trust, state = tmp_path / "trust", tmp_path / "state"
    (trust / "bundles").mkdir(parents=True)
    key, pem, kid = _signer()
    (trust / "bundles" / "fleet.pub").write_bytes(pem)
    state.mkdir()
    (state / "revoked-keys.json").write_text("{not json")
    store = TrustStore(trust, state)
    with pytest.raises(BundleRefused, match=r"revocation list .* unreadable"):
        store.verify_bundle(*_sign(key, kid), kid)
    bundle = tmp_path / "installed"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"key_id": kid}))
    assert store.revoked_signer(bundle) == kid  # fail closed: counts as revoked
    assert store.describe(bundle)["active_signer_revoked"] is True


def test_a_log_file_inside_the_trust_folder_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    settings = Settings()
    settings.logging.file = state / "trust" / "bundles" / "edgeserve.pub"
    problem = log_file_problem(settings, state)
    assert problem is not None and "inside the trust folder" in problem
    settings.ota.trust_dir = tmp_path / "etc-trust"
    settings.logging.file = tmp_path / "etc-trust" / "sub" / ".." / "commands" / "x.log"
    assert log_file_problem(settings, state) is not None
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "link").symlink_to(tmp_path / "etc-trust")
    settings.logging.file = tmp_path / "logs" / "link" / "bundles" / "x.pub"
    assert log_file_problem(settings, state) is not None  # through a symlink too
    settings.logging.file = state / "trust" / "x.pub"  # the old default folder stays off limits
    assert log_file_problem(settings, state) is not None
    settings.logging.file = tmp_path / "logs" / "edgeserve.log"
    assert log_file_problem(settings, state) is None
    assert trust_dir_for(settings, state) == tmp_path / "etc-trust"


def test_config_check_refuses_a_log_file_in_the_trust_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "edgeserve.toml"
    config.write_text(
        f'[ota]\ntrust_dir = "{tmp_path}/etc-trust"\n'
        f'[logging]\nfile = "{tmp_path}/etc-trust/bundles/log.pub"\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", "config", "check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "EDGESERVE_SERVER_STATE_DIR": str(tmp_path / "state")},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "logging.file" in result.stderr and "inside the trust folder" in result.stderr
