"""`edgeserve config check` warnings (settings_warnings.py): one function per concern, in CHECKS."""

from __future__ import annotations

import pytest

from edgeserve import settings_warnings
from edgeserve.config import Settings


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("ipc:///tmp/edgeserve.zmq", None),
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
