"""WATCHDOG=1 only while the server answers its health check; a wedged server gets no ping."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from appliance import ApplianceFactory, wait_until

QUIET_S = 3.0  # six missed pings: the supervisor stopped pinging, not a late one


def test_pings_at_half_the_interval_and_stop_while_the_server_is_wedged(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    """Waits on the pings themselves, never on a count within a time: a busy box only delays them."""
    app = appliance_factory(
        mlp_repo, watchdog_usec=1_000_000,
        config="[supervisor]\nhealth_interval_s = 0.25\nhealth_timeout_s = 0.5\nhang_timeout_s = 0\n",
    )  # fmt: skip
    app.notify.wait_for("READY", timeout=60)
    assert "systemd watchdog: pinging every 0.5s" in app.log()  # half of WATCHDOG_USEC
    start = time.monotonic()
    wait_until(lambda: len(app.notify.with_key("WATCHDOG", since=start)) >= 4, 60, "four pings")
    server = app.server_pid()
    os.kill(server, signal.SIGSTOP)
    try:
        # The pings earned by the last answers before the stop may still come; then none at all. A
        # stretch of QUIET_S without one shows it (a server that answers is pinged for every 0.5 s).
        def quiet() -> bool:
            pings = app.notify.with_key("WATCHDOG")
            return time.monotonic() - (pings[-1].at if pings else 0.0) >= QUIET_S

        wait_until(quiet, 60, f"{QUIET_S} s without a ping while the server is stopped")
        assert app.server_pid() == server  # hang_timeout_s = 0: left to systemd's watchdog
    finally:
        os.kill(server, signal.SIGCONT)
    resumed = time.monotonic()
    app.notify.wait_for("WATCHDOG", timeout=60, since=resumed)
    assert app.server_pid() == server


def test_supervisor_kills_a_server_silent_past_hang_timeout(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    # hang_timeout_s also bounds a starting server's first answer: on a saturated box a start took
    # longer than 2 s to answer (and was killed, again and again), so the timeout is a generous one.
    # The metrics port is taken: the server logs an ERROR line (not fatal) before it hangs, and the
    # status must still name the hang, the reason it was killed (that line once hid it).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        app = appliance_factory(
            mlp_repo,
            config="[supervisor]\nhealth_interval_s = 0.25\nhealth_timeout_s = 0.5\nhang_timeout_s = 30\n"
            "restart_initial_s = 0.1\n",
            env={"EDGESERVE_METRICS_PORT": str(taken.getsockname()[1])},
        )
        app.notify.wait_for("READY", timeout=120)
        assert "metrics listener cannot listen" in app.log()
        server = app.server_pid()
        os.kill(server, signal.SIGSTOP)
        replacement = app.server_pid(not_pid=server, timeout=120)
        assert replacement != server
        app.wait_ready(120)
    assert "did not answer its health check for 30s" in app.log()
    wait_until(lambda: any("did not answer" in s for s in app.notify.statuses()), 60, "STATUS with the hang")
