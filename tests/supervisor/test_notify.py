"""The notify protocol against real datagram sockets bound by the test (path and abstract names)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from notify_socket import NotifyListener

from edgeserve.supervisor.notify import Notifier, child_environment


def test_path_socket_gets_one_datagram_per_message(tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        notifier = Notifier({"NOTIFY_SOCKET": listener.address})
        assert notifier.enabled
        assert notifier.send(READY=1, STATUS="serving · 1/1 models ready", MAINPID=os.getpid())
        message = listener.wait_for("READY", "1", timeout=5)
        assert message.fields == {
            "READY": "1",
            "STATUS": "serving · 1/1 models ready",
            "MAINPID": str(os.getpid()),
        }
        notifier.close()
    finally:
        listener.close()


def test_abstract_socket_name_with_at_sign() -> None:
    listener = NotifyListener(abstract=f"edgeserve-notify-unit-{os.getpid()}")
    try:
        assert listener.address.startswith("@")
        notifier = Notifier({"NOTIFY_SOCKET": listener.address})
        assert notifier.send(STOPPING=1)
        assert listener.wait_for("STOPPING", "1", timeout=5).fields == {"STOPPING": "1"}
    finally:
        listener.close()


def test_without_systemd_every_call_is_a_quiet_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled and notifier.watchdog_interval_s is None
    assert notifier.send(READY=1) is False
    assert Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled is False  # not a socket address


def test_gone_manager_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert notifier.send(WATCHDOG=1) is False
    assert notifier.send(WATCHDOG=1) is False


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_pid_only() -> None:
    assert Notifier({"WATCHDOG_USEC": "4000000"}).watchdog_interval_s == 2.0
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 2.0
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "zero"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval_s is None


def test_server_child_never_inherits_the_notify_variables() -> None:
    env = child_environment(
        {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    )
    assert env == {"PATH": "/bin"}


def test_listener_records_arrival_order(tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "n.sock")
    try:
        notifier = Notifier({"NOTIFY_SOCKET": listener.address})
        for i in range(5):
            notifier.send(STATUS=f"step {i}")
        deadline = time.monotonic() + 5
        while len(listener.statuses()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.statuses() == [f"step {i}" for i in range(5)]
    finally:
        listener.close()
