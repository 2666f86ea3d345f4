"""The device's fleet agent end to end: a real `edgeserve run` with `[fleet] broker` set, a real
Mosquitto, commands published (signed) as a fleet manager would, every verb, duplicates, expired and
retained commands, the broker killed mid-deployment, the agent killed mid-deployment, TLS with client
certs. The attacks on the signed commands are in tests/security/test_fleet_commands.py."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from appliance import Appliance, start_appliance, wait_until
from broker import Mosquitto, needs_mosquitto
from bundle_server import BundleServer
from commander import Commander
from fleet_keys import trust
from ota_fixtures import FAST, Fleet, edgeserve, make_fleet

pytestmark = needs_mosquitto()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    server = Mosquitto(tmp_path / "broker").start()
    yield server
    server.kill()


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    fleet = make_fleet(tmp_path)
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    return fleet


# The bundles these tests deploy lie on this machine: file:// and the loopback BundleServer.
FLEET_URLS = "allow_file_urls = true\nallow_loopback_urls = true\n"


def _device(broker: Mosquitto, fleet: Fleet, tmp: Path, extra: str = "", env: dict[str, str] | None = None,
            protocol: str = "5") -> Appliance:  # fmt: skip
    (tmp / "empty").mkdir(parents=True, exist_ok=True)
    trust(fleet.state / "trust" / "commands")  # the default [fleet] command_keys folder
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "lab"\ndevice_id = "cam-1"\nprotocol = "{protocol}"\n'
        f"metrics_interval_s = 1.0\n{extra}[ota]\ntrial_window_s = 1.0\n{FLEET_URLS}"
        "[supervisor]\nrestart_initial_s = 0.2\n"
    )
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(fleet.state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": "", **(env or {})})  # fmt: skip
    app.notify.wait_for("READY", timeout=60)
    return app


@pytest.fixture
def device(broker: Mosquitto, fleet: Fleet, tmp_path: Path) -> Iterator[Appliance]:
    app = _device(broker, fleet, tmp_path)
    yield app
    app.stop()


@pytest.fixture
def manager(broker: Mosquitto) -> Iterator[Commander]:
    commander = Commander("127.0.0.1", broker.port, "lab", "cam-1")
    yield commander
    commander.close()


def _statuses(manager: Commander, cmd_id: str) -> list[str]:
    return [a["status"] for a in manager.all_answers(cmd_id)]


def test_state_info_health_and_metrics_on_connect(device: Appliance, manager: Commander) -> None:
    state = manager.wait_on("state", lambda b: b.get("online") is True)
    assert state["device"] == "cam-1" and state["version"] and state["boot_id"]
    info = manager.wait_on("info", lambda b: "hardware" in b)
    assert info["hardware"]["arch"] and info["bundle"]["active_version"] == 1
    assert manager.wait_on("health", lambda b: b.get("status") == "ok")["checks"] == []
    reported = manager.wait_on("reported", lambda b: b.get("active_version") == 1)
    assert reported["models"] == {"mlp": "READY"}
    metrics = manager.wait_on("metrics", lambda b: "cpu_percent" in b)
    assert metrics["memory_percent"] > 0 and metrics["server_rss_mb"] > 0
    retained = {topic for topic, _, kept in manager.messages if kept}
    assert {f"{manager.base}/{leaf}" for leaf in ("state", "info", "health", "reported")} <= retained


def test_every_verb(device: Appliance, manager: Commander, fleet: Fleet) -> None:
    # get_status
    status = manager.wait(manager.send("get_status"))
    assert status["status"] == "SUCCEEDED" and status["result"]["active_version"] == 1
    # deploy_bundle: ACCEPTED -> IN_PROGRESS (progress) -> SUCCEEDED, install events on `events`
    url = fleet.bundle(2).as_uri()
    deploy = manager.send("deploy_bundle", {"url": url})
    final = manager.wait(deploy)
    assert final["status"] == "SUCCEEDED" and final["result"]["version"] == 2, final
    statuses = _statuses(manager, deploy)
    assert statuses[0] == "ACCEPTED" and "IN_PROGRESS" in statuses and statuses[-1] == "SUCCEEDED"
    assert any(a.get("progress") is not None for a in manager.all_answers(deploy))
    manager.wait_on("events", lambda e: e.get("cmd_id") == deploy and e.get("state") == "COMMITTED")
    events = [e for e in manager.on("events") if e.get("cmd_id") == deploy]
    assert [e["state"] for e in events][-1] == "COMMITTED" and "VERIFYING" in [e["state"] for e in events]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    # the same deploy again (a new cmd_id): a successful no-op
    again = manager.wait(manager.send("deploy_bundle", {"url": url}))
    assert again["status"] == "SUCCEEDED" and "already serves" in again["result"]["reason"]
    # rollback
    back = manager.wait(manager.send("rollback", {"to_version": 1}))
    assert back["status"] == "SUCCEEDED" and back["result"]["state"] == "ROLLED_BACK"
    # deactivate / activate a model
    assert manager.wait(manager.send("deactivate_model", {"model": "mlp"}))["status"] == "SUCCEEDED"
    assert device.get("/v2/models/mlp/ready") == 400
    assert manager.wait(manager.send("activate_model", {"model": "mlp"}))["status"] == "SUCCEEDED"
    assert device.get("/v2/models/mlp/ready") == 200
    # set_config: validated, persisted, applied live
    ok = manager.wait(manager.send("set_config", {"logging": {"level": "DEBUG"}}))
    assert ok["status"] == "SUCCEEDED" and ok["result"]["restarted_for"] == []
    assert 'level = "DEBUG"' in (fleet.state / "fleet" / "settings.toml").read_text()
    bad = manager.wait(manager.send("set_config", {"http": {"max_connections": 0}}))
    assert bad["status"] == "FAILED" and "http.max_connections" in bad["error"]
    # restart_runtime
    before = device.server_pid()
    restarted = manager.wait(manager.send("restart_runtime"))
    assert restarted["status"] == "SUCCEEDED" and restarted["result"]["old_pid"] == before
    assert device.server_pid() != before
    # gc
    assert manager.wait(manager.send("gc"))["status"] == "SUCCEEDED"


def test_duplicates_expired_retained_bad_and_foreign_commands(device: Appliance, manager: Commander,
                                                              fleet: Fleet) -> None:  # fmt: skip
    url = fleet.bundle(2).as_uri()
    first = manager.wait(manager.send("deploy_bundle", {"url": url}, cmd_id="deploy-dup-1"))
    assert first["status"] == "SUCCEEDED"
    manager.answers.pop("deploy-dup-1")
    second = manager.wait(manager.send("deploy_bundle", {"url": url}, cmd_id="deploy-dup-1"))
    assert second["status"] == "SUCCEEDED" and second.get("duplicate") is True
    installs = [h for h in edgeserve_status(fleet)["history"] if h.get("version") == 2]
    assert len(installs) == 1  # it ran once
    expired = manager.wait(manager.send("get_status", expires_in_s=-5))
    assert expired["status"] == "REJECTED" and "expired" in expired["error"]
    retained = manager.wait(manager.send("rollback", {"to_version": 1}, retain=True))
    assert retained["status"] == "REJECTED" and "retained" in retained["error"]
    manager.client.publish(f"{manager.base}/cmd/rollback", b"", qos=1, retain=True)  # clear it
    bad = manager.wait(manager.send("rollback", {"to_version": "one"}))
    assert bad["status"] == "REJECTED" and "to_version" in bad["error"]
    unknown = manager.wait(manager.send("format_disk"))
    assert unknown["status"] == "REJECTED" and "unknown verb" in unknown["error"]
    foreign = manager.wait(manager.send("get_status", extra={"device": "cam-2"}))
    assert foreign["status"] == "REJECTED" and "cam-2" in foreign["error"]
    assert edgeserve_status(fleet)["active_version"] == 2


def edgeserve_status(fleet: Fleet) -> dict[str, Any]:
    from ota_fixtures import status

    return status(fleet.state)


def test_one_long_command_at_a_time_queue_and_cancel(broker: Mosquitto, fleet: Fleet, tmp_path: Path,
                                                     manager: Commander) -> None:  # fmt: skip
    server = BundleServer().start()
    app = _device(broker, fleet, tmp_path, extra="max_queued_commands = 1\n")
    try:
        data = fleet.bundle(2).read_bytes()
        slow = server.add("/slow.esb", data, stall_after=1000, stall_s=4, times=1)
        running = manager.send("deploy_bundle", {"url": slow})
        manager.wait_on("events", lambda e: e.get("cmd_id") == running)
        queued = manager.send("gc")
        busy = manager.wait(manager.send("restart_runtime"))
        assert busy["status"] == "REJECTED" and "busy" in busy["error"]
        cancel = manager.wait(manager.send("cancel", {"cmd_id": queued}))
        assert cancel["status"] == "SUCCEEDED" and cancel["result"]["was"] == "queued"
        assert manager.wait(queued)["status"] == "FAILED"
        assert manager.wait(running)["status"] == "SUCCEEDED"
    finally:
        app.stop()
        server.stop()


def test_broker_killed_and_restarted_mid_deployment(broker: Mosquitto, fleet: Fleet, tmp_path: Path) -> None:
    server = BundleServer().start()
    app = _device(broker, fleet, tmp_path)
    manager = Commander("127.0.0.1", broker.port, "lab", "cam-1")
    try:
        data = fleet.bundle(2).read_bytes()
        url = server.add("/v2.esb", data, stall_after=len(data) // 2, stall_s=3, times=1)
        deploy = manager.send("deploy_bundle", {"url": url})
        manager.wait_on("events", lambda e: e.get("cmd_id") == deploy)
        manager.close()
        broker.restart(hard=True)  # SIGKILL: the broker is gone mid-download
        time.sleep(2)
        manager = Commander("127.0.0.1", broker.port, "lab", "cam-1", name=manager.name)  # same reply topic
        final = manager.wait(deploy, timeout_s=120)
        assert final["status"] == "SUCCEEDED", final
        committed = lambda: any(  # noqa: E731
            e.get("state") == "COMMITTED" and e.get("cmd_id") == deploy for e in manager.on("events")
        )
        wait_until(committed, 30, "the buffered COMMITTED event")
        assert edgeserve_status(fleet)["active_version"] == 2
        installs = [h for h in edgeserve_status(fleet)["history"] if h.get("version") == 2]
        assert len(installs) == 1  # nothing ran twice
    finally:
        manager.close()
        app.stop()
        server.stop()


def test_agent_killed_mid_deployment(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, manager: Commander
) -> None:
    app = _device(broker, fleet, tmp_path, env={"EDGESERVE_TEST_OTA_HOLD": "LOADING", **FAST})
    deploy = manager.send("deploy_bundle", {"url": fleet.bundle(2).as_uri()}, cmd_id="deploy-killed")
    wait_until(lambda: (fleet.state / "ota" / "held").exists(), 60, "the install to reach LOADING")
    app.process.kill()  # the supervisor and its agent, mid-install
    app.process.wait(10)
    (fleet.state / "ota" / "held").unlink()
    offline = manager.wait_on("state", lambda b: b.get("online") is False)  # the will
    assert offline["device"] == "cam-1"
    again = _device(broker, fleet, tmp_path / "again")
    try:
        final = manager.wait(deploy)
        assert final["status"] == "FAILED" and "interrupted" in final["error"]
        manager.answers.pop(deploy)
        redelivered = manager.wait(
            manager.send("deploy_bundle", {"url": "file:///x"}, cmd_id="deploy-killed")
        )
        assert redelivered["status"] == "FAILED" and redelivered.get("duplicate") is True
        assert edgeserve_status(fleet)["active_version"] == 1  # the old bundle serves, whole
    finally:
        again.stop()


def test_mqtt_311_answers_on_resp_topic(broker: Mosquitto, fleet: Fleet, tmp_path: Path) -> None:
    app = _device(broker, fleet, tmp_path, protocol="3.1.1")
    manager = Commander("127.0.0.1", broker.port, "lab", "cam-1", v5=False)
    try:
        answer = manager.wait(manager.send("get_status"))
        assert answer["status"] == "SUCCEEDED" and answer["result"]["server_ready"] is True
        assert any("/resp/" in topic for topic, _, _ in manager.messages)
    finally:
        manager.close()
        app.stop()


def test_tls_with_client_certificates(tmp_path: Path, fleet: Fleet) -> None:
    broker = Mosquitto(tmp_path / "tls-broker", tls=True).start()
    device = broker.client_options("cam-1")
    extra = (f'ca_file = "{device["ca_file"]}"\ncert_file = "{device["cert_file"]}"\n'
             f'key_file = "{device["key_file"]}"\n')  # fmt: skip
    _assert_get_status_over(broker, fleet, tmp_path, extra, broker.client_options("ops"))


def test_desired_state_applied_once_per_generation(
    device: Appliance, manager: Commander, fleet: Fleet
) -> None:
    desired = {"generation": 7, "bundle": {"url": fleet.bundle(2).as_uri()}}
    manager.set_desired(desired)  # signed for the desired topic, retained
    reported = manager.wait_on(
        "reported", lambda b: b.get("generation") == 7 and b.get("active_version") == 2, timeout_s=120
    )
    assert reported["generation_outcome"] == "applied" and reported["desired_rejected"] is None
    # The retained desired state comes again at every reconnect: the generation is not applied twice.
    device.signal(signal.SIGHUP)
    manager.set_desired(desired)
    time.sleep(2)
    installs = [h for h in edgeserve_status(fleet)["history"] if h.get("version") == 2]
    assert len(installs) == 1
    manager.set_desired(None)  # clear the retained state


def test_username_and_password(tmp_path: Path, fleet: Fleet) -> None:
    broker = Mosquitto(tmp_path / "auth-broker", users={"cam-1": "s3cret"}).start()
    extra = 'username = "cam-1"\npassword = "s3cret"\n'
    _assert_get_status_over(broker, fleet, tmp_path, extra, {"username": "cam-1", "password": "s3cret"})


def _assert_get_status_over(
    broker: Mosquitto, fleet: Fleet, tmp_path: Path, extra: str, manager_options: dict[str, Any]
) -> None:
    """A device connected to `broker` with the [fleet] lines `extra` answers get_status; `broker` is
    killed afterwards."""
    try:
        app = _device(broker, fleet, tmp_path, extra=extra)
        manager = Commander("127.0.0.1", broker.port, "lab", "cam-1", **manager_options)
        try:
            assert manager.wait(manager.send("get_status"))["status"] == "SUCCEEDED"
        finally:
            manager.close()
            app.stop()
    finally:
        broker.kill()
