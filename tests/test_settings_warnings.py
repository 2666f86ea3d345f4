"""`edgeserve config check` warnings (settings_warnings.py): one function per concern, in CHECKS."""

from __future__ import annotations

import pytest

from edgeserve import settings_warnings
from edgeserve.config import Settings


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("ipc:///run/edgeserve/edgeserve.zmq", None),
        ("inproc://x", None),
        ("tcp://127.0.0.1:5555", "127.0.0.1"),
        ("tcp://*:5555", "*"),
        ("tcp://[::1]:5555", "::1"),
        ("tcp://eth0:*", "eth0"),
        ("tcp://10.0.0.1;192.168.1.2:5555", "192.168.1.2"),
        ("ws://0.0.0.0:8080/path", "0.0.0.0"),
    ],
)
def test_zmq_host(endpoint: str, host: str | None) -> None:
    assert settings_warnings.zmq_host(endpoint) == host


def test_loopback_listeners_are_quiet_whatever_their_admin_setting() -> None:
    settings = Settings()
    settings.http.admin_loopback_only = settings.grpc.admin_loopback_only = False
    settings.zmq.endpoints = ["tcp://localhost:5555", "tcp://lo:5556", "tcp://[::1]:5557"]
    assert settings_warnings.risky_settings(settings) == []


def test_a_disabled_listener_is_not_warned_about() -> None:
    settings = Settings()
    settings.http.host = settings.grpc.host = ""  # every interface
    settings.zmq.endpoints = ["tcp://0.0.0.0:5555"]
    assert len(settings_warnings.risky_settings(settings)) == 5
    settings.http.enabled = settings.grpc.enabled = settings.zmq.enabled = False
    assert settings_warnings.risky_settings(settings) == []


def test_a_fully_protected_listener_is_quiet() -> None:
    settings = Settings()
    settings.grpc.enabled = False
    http = settings.http
    http.host, http.token = "0.0.0.0", "x" * 32
    http.tls_cert, http.tls_key = "cert.pem", "key.pem"  # type: ignore[assignment]
    assert settings_warnings.risky_settings(settings) == []


def test_checks_are_extensible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_warnings, "CHECKS", [*settings_warnings.CHECKS, lambda s: ["fleet: x"]])
    assert settings_warnings.risky_settings(Settings()) == ["fleet: x"]


def test_fleet_and_ota_lab_settings_are_warned_about() -> None:
    settings = Settings()
    settings.fleet.broker = "mqtts://broker.example:8883"
    assert settings_warnings.risky_settings(settings) == []
    settings.fleet.require_signed_commands = False
    settings.ota.allow_file_urls = settings.ota.allow_link_local_urls = True
    warnings = settings_warnings.risky_settings(settings)
    assert len(warnings) == 3, warnings
    assert "require_signed_commands = false" in warnings[0]
    assert "allow_file_urls" in warnings[1] and "cloud metadata" in warnings[2]
    settings.fleet.broker = "mqtt://broker.example:1883"
    assert any("without TLS" in w for w in settings_warnings.risky_settings(settings))
    settings.fleet.broker = "mqtt://127.0.0.1:1883"  # a local broker (a bridge) is not warned about
    assert not any("without TLS" in w for w in settings_warnings.risky_settings(settings))
