"""Fixtures for the fleet tests: a real mosquitto (plain, TLS with client certificates, or with passwords)
and simulated device agents. Everything skips, with the reason, only when mosquitto is not installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/fleet/broker.py, tests/fleet/sim_agent.py

from broker import Mosquitto, find_mosquitto

MOSQUITTO = find_mosquitto()
needs_mosquitto = pytest.mark.skipif(
    MOSQUITTO is None,
    reason="mosquitto is not installed (scripts/test.sh installs it: apt-get install mosquitto)",
)


def _broker(tmp_path: Path, name: str, **options: object) -> Iterator[Mosquitto]:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (scripts/test.sh installs it: apt-get install mosquitto)")
    broker = Mosquitto(tmp_path / name, **options).start()  # type: ignore[arg-type]
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A plain anonymous broker on a free loopback port, persistence under tmp_path."""
    yield from _broker(tmp_path, "broker")


@pytest.fixture
def mosquitto_tls(tmp_path: Path) -> Iterator[Mosquitto]:
    """A TLS-only broker: test CA, server cert for 127.0.0.1, client certificates required (CN = username)."""
    yield from _broker(tmp_path, "broker-tls", tls=True)


@pytest.fixture
def mosquitto_auth(tmp_path: Path) -> Iterator[Mosquitto]:
    """A broker with a password file (users ops/ops-secret and dev/dev-secret), no anonymous access."""
    yield from _broker(tmp_path, "broker-auth", users={"ops": "ops-secret", "dev": "dev-secret"})
