"""WATCHDOG=1 only while the server answers its health check; a wedged server gets no ping."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from appliance import ApplianceFactory, wait_until


def test_pings_at_half_the_interval_and_stop_while_the_server_is_wedged(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    app = appliance_factory(
        mlp_repo, watchdog_usec=1_000_000,
        config="[supervisor]\nhealth_interval_s = 0.25\nhealth_timeout_s = 0.5\nhang_timeout_s = 0\n",
    )  # fmt: skip
    app.notify.wait_for("READY", timeout=60)
    start = time.monotonic()
    time.sleep(3)
    healthy = app.notify.with_key("WATCHDOG", since=start)
    assert 4 <= len(healthy) <= 8, len(healthy)  # every 0.5 s
    server = app.server_pid()
    os.kill(server, signal.SIGSTOP)
    try:
        time.sleep(1.5)  # pings earned by the last answers before the stop
        wedged_from = time.monotonic()
        time.sleep(3)
        assert app.notify.with_key("WATCHDOG", since=wedged_from) == []
        assert app.server_pid() == server  # hang_timeout_s = 0: left to systemd's watchdog
    finally:
        os.kill(server, signal.SIGCONT)
    resumed = time.monotonic()
    app.notify.wait_for("WATCHDOG", timeout=5, since=resumed)
    assert app.server_pid() == server


def test_supervisor_kills_a_server_silent_past_hang_timeout(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    app = appliance_factory(
        mlp_repo,
        config="[supervisor]\nhealth_interval_s = 0.25\nhealth_timeout_s = 0.5\nhang_timeout_s = 2\n"
        "restart_initial_s = 0.1\n",
    )
    app.notify.wait_for("READY", timeout=60)
    server = app.server_pid()
    os.kill(server, signal.SIGSTOP)
    replacement = app.server_pid(not_pid=server, timeout=20)
    assert replacement != server
    app.wait_ready(60)
    assert "did not answer its health check for 2s" in app.log()
    wait_until(lambda: any("did not answer" in s for s in app.notify.statuses()), 10, "STATUS with the hang")
