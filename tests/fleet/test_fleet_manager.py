"""The fleet manager (edgeserve/fleet/manager.py) and `edgeserve fleet ...` (fleet_cli.py) against a real
mosquitto with simulated device agents (tests/fleet/sim_agent.py), each on its own MQTT connection and
each running only commands signed by the test command key (tests/fleet/fleet_keys.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from broker import Mosquitto, Spy
from fleet_keys import COMMAND_KEY, OTHER_KEY, trusted, write_private
from sim_agent import SimConfig, SimFleet

from edgeserve.fleet.fleet_cli import add_commands, main
from edgeserve.fleet.manager import FleetError, FleetManager
from edgeserve.fleet.protocol import CommandError, utc
from edgeserve.fleet.records import plan_waves, select_devices
from edgeserve.fleet.signed import open_envelope, sign_command

FLEET = "plant-7"
URL_V2 = "https://bundles.example/plant-7/bundle-v2.tar"


@pytest.fixture
def sims(mosquitto: Mosquitto) -> Iterator[SimFleet]:
    fleet = SimFleet(mosquitto.url, FLEET, command_keys=trusted())
    yield fleet
    fleet.stop()


def manager_for(broker: Mosquitto, **options: Any) -> FleetManager:
    defaults = {**broker.client_options("manager"), "command_key": COMMAND_KEY}
    return FleetManager(broker.url, FLEET, **{**defaults, **options})


def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# -- pure logic -------------------------------------------------------------------------------------------


def test_selectors_and_wave_plan() -> None:
    records = [{"device": d, "online": d != "door-1"} for d in ("cam-01", "cam-02", "door-1", "door-2")]
    assert select_devices(records, "all") == ["cam-01", "cam-02", "door-1", "door-2"]
    assert select_devices(records, "online") == ["cam-01", "cam-02", "door-2"]
    assert select_devices(records, "cam-*") == ["cam-01", "cam-02"]
    assert select_devices(records, "door-2, cam-0[1]") == ["cam-01", "door-2"]
    with pytest.raises(FleetError, match="not known"):
        select_devices(records, "cam-01,cam-99")
    with pytest.raises(FleetError, match="matches no device"):
        select_devices(records, "gate-*")
    devices = [f"d{i:02d}" for i in range(20)]
    assert [len(w) for w in plan_waves(devices, 10, 6)] == [2, 6, 6, 6]
    assert [len(w) for w in plan_waves(devices, 1, 10)] == [1, 10, 9]  # ceil, at least 1
    assert [len(w) for w in plan_waves(devices, 0, 8)] == [8, 8, 4]  # no canary
    assert [len(w) for w in plan_waves(devices, 100, 8)] == [20]
    assert plan_waves(devices, 10, 6)[0] == ["d00", "d01"]


def test_broker_url_and_ids_are_checked() -> None:
    with pytest.raises(FleetError, match="scheme"):
        FleetManager("http://127.0.0.1:1883", FLEET)
    with pytest.raises(FleetError, match="fleet"):
        FleetManager("mqtt://127.0.0.1:1883", "a/b")
    with pytest.raises(FleetError, match="not connected"):
        FleetManager("mqtt://127.0.0.1:1", FLEET).send("cam-01", "get_status", {})


def test_unreachable_broker_is_one_error() -> None:
    from broker import free_port

    with pytest.raises(FleetError, match="cannot connect"):
        FleetManager(f"mqtt://127.0.0.1:{free_port()}", FLEET).connect()


# -- devices ----------------------------------------------------------------------------------------------


def test_devices_online_offline_via_will_and_retained_across_restart(
    mosquitto: Mosquitto, sims: SimFleet, tmp_path: Path
) -> None:
    sims.add(["cam-01", "cam-02"], active_version=3, previous_version=2)
    sims.add(["door-1"])
    script = Path(__file__).with_name("sim_agent.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), "--broker", mosquitto.url, "--fleet", FLEET, "--device", "gate-9"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with manager_for(mosquitto) as manager:
            records = {r["device"]: r for r in manager.devices()}
            assert sorted(records) == ["cam-01", "cam-02", "door-1", "gate-9"]
            assert all(r["online"] for r in records.values())
            cam = records["cam-01"]
            assert (cam["active_version"], cam["previous_version"], cam["health"]) == (3, 2, "ok")
            assert cam["bundle_name"] == "sim-bundle" and cam["backends"] == {"mlp": "onnxruntime"}

            proc.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker publishes the will
            proc.wait(10)
            sims["door-1"].crash()  # the same, in-process
            sims["cam-02"].stop()  # a clean stop says offline itself
            wait_for(lambda: sum(r["online"] for r in manager.devices()) == 1)
            records = {r["device"]: r for r in manager.devices()}
            assert {d for d, r in records.items() if r["online"]} == {"cam-01"}
            assert records["gate-9"]["active_version"] == 1  # retained info/reported stay

            mosquitto.restart()  # persistence: the retained picture survives; paho reconnects
            wait_for(lambda: manager._ready.is_set(), 15)
            records = {r["device"]: r for r in manager.devices()}
            assert sorted(records) == ["cam-01", "cam-02", "door-1", "gate-9"]
            wait_for(lambda: sims["cam-01"].connected.is_set())
            wait_for(lambda: manager.send("cam-01", "get_status", {}, 3)["status"] == "SUCCEEDED", 20)
        with manager_for(mosquitto) as fresh:  # a new manager sees it all from the retained topics
            assert len(fresh.devices()) == 4
    finally:
        proc.kill()
        proc.wait()


# -- send -------------------------------------------------------------------------------------------------


def test_send_mqtt5_response_topic_and_correlation(mosquitto: Mosquitto, sims: SimFleet) -> None:
    sims.add(["cam-01"], config=SimConfig(install_s=0.4))
    spy = Spy(mosquitto, f"es/v1/{FLEET}/+/cmd/#")
    updates: list[dict[str, Any]] = []
    try:
        with manager_for(mosquitto, client_id="ops-1") as manager:
            answer = manager.send("cam-01", "deploy_bundle", {"url": URL_V2}, 10, updates.append)
            status = manager.send("cam-01", "get_status", {}, 5)
    finally:
        spy.close()
    assert [u["status"] for u in updates] == ["ACCEPTED", "IN_PROGRESS", "SUCCEEDED"]
    assert updates[1]["progress"] == 0.5
    assert answer["status"] == "SUCCEEDED" and answer["result"] == {
        "active_version": 2,
        "previous_version": 1,
    }
    assert status["result"]["active_version"] == 2
    message = spy.messages[0]
    envelope = json.loads(message.payload)
    assert message.topic == f"es/v1/{FLEET}/cam-01/cmd/deploy_bundle"
    assert message.qos == 1 and not message.retain
    assert set(envelope) == {"v", "key_id", "sig", "command"} and envelope["v"] == 1
    body = json.loads(open_envelope(message.topic, message.payload, trusted()).text)
    assert set(body) == {"cmd_id", "issued_at", "expires_at", "args"} and body["args"] == {"url": URL_V2}
    assert body["cmd_id"] == answer["cmd_id"]
    issued = datetime.fromisoformat(body["issued_at"].replace("Z", "+00:00"))
    expires = datetime.fromisoformat(body["expires_at"].replace("Z", "+00:00"))
    assert timedelta(seconds=10) <= expires - issued <= timedelta(seconds=12)
    assert message.properties.ResponseTopic == f"es/v1/{FLEET}/manager/ops-1/resp"
    assert message.properties.CorrelationData == body["cmd_id"].encode()


def test_send_mqtt311_answers_on_resp_cmd_id(mosquitto: Mosquitto, sims: SimFleet) -> None:
    sims.add(["cam-01"], protocol="3.1.1")
    spy = Spy(mosquitto, f"es/v1/{FLEET}/cam-01/#", protocol=mqtt.MQTTv311)
    try:
        with manager_for(mosquitto, protocol="3.1.1") as manager:
            answer = manager.send("cam-01", "deploy_bundle", {"url": URL_V2}, 10)
            assert answer["status"] == "SUCCEEDED"
            failed = manager.send("cam-01", "rollback", {"to_version": 7}, 5)
            assert failed["status"] == "FAILED" and "not installed" in failed["error"]
    finally:
        spy.close()
    resp_topic = f"es/v1/{FLEET}/cam-01/resp/{answer['cmd_id']}"
    statuses = [json.loads(m.payload)["status"] for m in spy.messages if m.topic == resp_topic]
    assert statuses == ["ACCEPTED", "IN_PROGRESS", "SUCCEEDED"]


def test_duplicate_cmd_id_expired_and_timeout(mosquitto: Mosquitto, sims: SimFleet) -> None:
    sims.add(["cam-01"])
    sims.add(["mute-1"], config=SimConfig(silent=True))
    with manager_for(mosquitto) as manager:
        first = manager.send("cam-01", "deploy_bundle", {"url": URL_V2}, 10, cmd_id="ops-dup-1")
        again = manager.send("cam-01", "deploy_bundle", {"url": URL_V2}, 10, cmd_id="ops-dup-1")
        assert first["status"] == again["status"] == "SUCCEEDED" and again["result"] == first["result"]
        assert sims["cam-01"].generation == 1  # ran once
        timed_out = manager.send("mute-1", "get_status", {}, 0.5)
        assert timed_out["status"] == "TIMEOUT" and "no answer at all" in timed_out["error"]

    # an expired command (published by hand: the manager never sends one) is REJECTED
    got: list[dict[str, Any]] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw", protocol=mqtt.MQTTv311)
    client.on_message = lambda c, u, m: got.append(json.loads(m.payload))
    client.connect("127.0.0.1", mosquitto.port)
    client.loop_start()
    try:
        client.subscribe(f"es/v1/{FLEET}/cam-01/resp/old-1", qos=1)
        time.sleep(0.3)
        past = datetime.now(timezone.utc) - timedelta(minutes=5)
        body = {
            "cmd_id": "old-1",
            "issued_at": utc(past),
            "expires_at": utc(past + timedelta(seconds=30)),
            "args": {},
        }
        topic = f"es/v1/{FLEET}/cam-01/cmd/get_status"
        client.publish(topic, sign_command(COMMAND_KEY, topic, json.dumps(body)), qos=1)
        wait_for(lambda: got, 5)
    finally:
        client.disconnect()
        client.loop_stop()
    assert got[0]["status"] == "REJECTED" and "expired" in got[0]["error"]


def test_unsigned_or_wrongly_signed_commands_are_refused_by_the_device(
    mosquitto: Mosquitto, sims: SimFleet, tmp_path: Path
) -> None:
    sims.add(["cam-01"])
    with manager_for(mosquitto, command_key=None) as manager:  # a lab manager, unsigned
        unsigned = manager.send("cam-01", "rollback", {"to_version": 1}, 5)
    with manager_for(mosquitto, command_key=OTHER_KEY) as manager:
        foreign = manager.send("cam-01", "rollback", {"to_version": 1}, 5)
    assert unsigned["status"] == "REJECTED" and "malformed signed command" in unsigned["error"]
    assert foreign["status"] == "REJECTED" and "not a trusted command key" in foreign["error"]
    assert sims["cam-01"].verbs() == [] and len(sims["cam-01"].refused) == 2  # nothing ran
    with pytest.raises(FleetError, match=r"command key .*nope\.key"):
        manager_for(mosquitto, command_key=tmp_path / "nope.key")
    (tmp_path / "public.pem").write_text("-----BEGIN PUBLIC KEY-----\n")
    with pytest.raises(FleetError, match="command key"):
        manager_for(mosquitto, command_key=str(tmp_path / "public.pem"))


def test_desired_state_is_signed_for_its_topic_and_retained(mosquitto: Mosquitto) -> None:
    topic = f"es/v1/{FLEET}/cam-01/desired"
    state = {"generation": 3, "bundle": {"url": URL_V2}}
    with manager_for(mosquitto) as manager:
        manager.set_desired("cam-01", state)
        with pytest.raises(FleetError, match="generation"):
            manager.set_desired("cam-01", {"bundle": {"url": URL_V2}})
    spy = Spy(mosquitto, topic)  # subscribes after the publish: only a retained message can arrive
    try:
        wait_for(lambda: spy.messages)
    finally:
        spy.close()
    message = spy.messages[0]
    assert message.retain and json.loads(open_envelope(topic, message.payload, trusted()).text) == state
    with pytest.raises(CommandError, match="bad signature"):  # bound to this device's desired topic
        open_envelope(f"es/v1/{FLEET}/cam-02/desired", message.payload, trusted())


def test_bad_arguments_are_refused_before_sending(mosquitto: Mosquitto) -> None:
    with manager_for(mosquitto) as manager:
        with pytest.raises(FleetError, match=r"args\.to_version"):
            manager.send("cam-01", "rollback", {}, 1)
        with pytest.raises(FleetError, match="unknown verb"):
            manager.send("cam-01", "reboot", {}, 1)
        with pytest.raises(FleetError, match="http"):
            manager.deploy("ftp://x/b.tar")


# -- deploy -----------------------------------------------------------------------------------------------


def devices20() -> list[str]:
    return [f"cam-{i:02d}" for i in range(20)]


def _deploy_in_waves_of_6(
    mosquitto: Mosquitto, url: str, sha256: str | None, selector: str, pause_s: float
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """A 10% canary, then waves of 6, stopping above 10% failed: (report, device records, events)."""
    events: list[dict[str, Any]] = []
    with manager_for(mosquitto) as manager:
        report = manager.deploy(
            url,
            sha256,
            selector,
            canary_percent=10,
            wave_size=6,
            pause_s=pause_s,
            max_failure_ratio=0.1,
            on_progress=events.append,
            timeout_s=20,
        )
        records = {r["device"]: r for r in manager.devices()}
    return report, records, events


def test_deploy_canary_then_waves_all_succeed(mosquitto: Mosquitto, sims: SimFleet) -> None:
    sims.add(devices20(), config=SimConfig(install_s=0.3))
    sims.add(["door-1"])  # not selected
    report, records, events = _deploy_in_waves_of_6(mosquitto, URL_V2, "ab" * 32, "cam-*", pause_s=0.2)
    assert report["ok"] and not report["stopped"]
    assert [w["size"] for w in report["waves"]] == [2, 6, 6, 6]
    assert report["waves"][0]["kind"] == "canary" and report["waves"][0]["devices"] == ["cam-00", "cam-01"]
    assert report["counts"]["succeeded"] == 20 and report["counts"]["failed"] == 0
    assert all(records[d]["active_version"] == 2 and records[d]["previous_version"] == 1 for d in devices20())
    assert records["door-1"]["active_version"] == 1 and sims["door-1"].verbs() == []
    assert all(sims[d].verbs() == ["deploy_bundle"] for d in devices20())
    assert sims["cam-05"].received[0][1]["args"] == {"url": URL_V2, "sha256": "ab" * 32}
    # each wave starts after the previous one is done, with the pause between
    kinds = [e["event"] for e in events if e["event"] in ("wave_start", "wave_done", "pause")]
    assert kinds == ["wave_start", "wave_done"] + ["pause", "wave_start", "wave_done"] * 3
    device_events = [e for e in events if e["event"] == "device"]
    assert {e["status"] for e in device_events} == {"ACCEPTED", "IN_PROGRESS", "SUCCEEDED"}
    assert events[0]["event"] == "start" and events[-1]["event"] == "done"


def test_deploy_over_the_threshold_stops_and_rolls_the_wave_back(
    mosquitto: Mosquitto, sims: SimFleet
) -> None:
    failing = {"cam-08", "cam-09"}  # in wave 2 (cam-08..cam-13): 2 of 14 tried > 0.1
    sims.add(
        [d for d in devices20() if d not in failing],
        config=SimConfig(install_s=0.3),
        active_version=4,
        previous_version=3,
    )
    sims.add(
        sorted(failing), config=SimConfig(install_s=0.3, fail=True), active_version=4, previous_version=3
    )
    url = "https://bundles.example/bundle-v5.tar"
    report, records, events = _deploy_in_waves_of_6(mosquitto, url, None, "all", pause_s=0.1)
    assert report["stopped"] and not report["ok"] and report["stopped_at_wave"] == 2
    assert "2/14" in report["reason"]
    wave2 = [f"cam-{i:02d}" for i in range(8, 14)]
    committed = [d for d in wave2 if d not in failing]
    later = [f"cam-{i:02d}" for i in range(14, 20)]
    assert sorted(report["rollback"]["devices"]) == committed
    assert all(
        r["to_version"] == 4 and r["status"] == "SUCCEEDED" for r in report["rollback"]["devices"].values()
    )
    for device in committed:  # rolled back to the version they ran before the rollout
        assert sims[device].verbs() == ["deploy_bundle", "rollback"]
        assert sims[device].received[1][1]["args"] == {"to_version": 4}
        assert records[device]["active_version"] == 4
    for device in failing:  # their install failed: they kept v4 themselves, no rollback sent
        assert sims[device].verbs() == ["deploy_bundle"] and records[device]["active_version"] == 4
        assert report["devices"][device]["status"] == "FAILED"
    for device in later:  # the later wave was never sent
        assert sims[device].verbs() == [] and records[device]["active_version"] == 4
        assert report["devices"][device]["status"] == "NOT_ATTEMPTED"
    for device in [f"cam-{i:02d}" for i in range(8)]:  # earlier waves keep the new version
        assert records[device]["active_version"] == 5 and sims[device].verbs() == ["deploy_bundle"]
    counts = report["counts"]
    assert (counts["tried"], counts["failed"], counts["not_attempted"], counts["rolled_back"]) == (
        14,
        2,
        6,
        4,
    )
    order = [e["event"] for e in events]
    assert (
        order.index("stop")
        < order.index("rollback_start")
        < order.index("rollback_done")
        < order.index("done")
    )
    assert order.count("wave_start") == 3


def test_deploy_failed_canary_stops_at_once_and_offline_devices_are_skipped(
    mosquitto: Mosquitto, sims: SimFleet
) -> None:
    sims.add(["cam-00"], config=SimConfig(fail=True, install_s=0.1))
    sims.add(["cam-01", "cam-02", "cam-03"], config=SimConfig(install_s=0.1))
    sims["cam-03"].crash()
    with manager_for(mosquitto) as manager:
        wait_for(lambda: not {r["device"]: r for r in manager.devices()}["cam-03"]["online"])
        report = manager.deploy(URL_V2, selector="all", canary_percent=10, wave_size=5, max_failure_ratio=0.5)
    assert report["stopped_at_wave"] == 0 and report["rollback"]["devices"] == {}
    assert report["devices"]["cam-03"]["status"] == "SKIPPED"
    assert sims["cam-01"].verbs() == [] and sims["cam-02"].verbs() == []


# -- watch ------------------------------------------------------------------------------------------------


def test_watch_sees_retained_state_and_live_events(mosquitto: Mosquitto, sims: SimFleet) -> None:
    sims.add(["cam-01", "cam-02"])
    seen: list[tuple[str, str, bool]] = []
    with manager_for(mosquitto) as manager:
        stop = manager.watch(lambda device, leaf, body, retained: seen.append((device, leaf, retained)))
        manager.send("cam-01", "deploy_bundle", {"url": URL_V2}, 10)
        wait_for(lambda: ("cam-01", "events", False) in seen)
        stop()
    assert ("cam-02", "state", True) in seen and ("cam-02", "health", True) in seen
    assert ("cam-01", "reported", False) in seen


# -- CLI --------------------------------------------------------------------------------------------------


def test_add_commands_registers_fleet_on_a_parser() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="edgeserve")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "fleet",
            "deploy",
            URL_V2,
            "--devices",
            "cam-*",
            "--canary",
            "5%",
            "--wave-size",
            "3",
            "--pause",
            "2",
            "--max-failure-ratio",
            "0.2",
            "--fleet",
            FLEET,
        ]
    )
    assert (args.command, args.fleet_command, args.canary, args.wave_size, args.max_failure_ratio) == (
        "fleet",
        "deploy",
        5.0,
        3,
        0.2,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["fleet", "deploy", URL_V2, "--canary", "150%"])


@pytest.fixture
def cli_env(mosquitto: Mosquitto, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The fleet CLI pointed at the test broker and fleet through its environment."""
    monkeypatch.setenv("EDGESERVE_FLEET_BROKER", mosquitto.url)
    monkeypatch.setenv("EDGESERVE_FLEET_FLEET", FLEET)
    return monkeypatch


def test_cli_devices_send_deploy_end_to_end(
    cli_env: pytest.MonkeyPatch, sims: SimFleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sims.add([f"cam-{i:02d}" for i in range(6)], config=SimConfig(install_s=0.2))
    sims.add(["cam-06"], config=SimConfig(install_s=0.2, fail=True))
    cli_env.setenv("EDGESERVE_FLEET_KEY", str(write_private(tmp_path / "keys" / "fleet-commands.key")))

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cam-00" in out and "7 devices, 7 online" in out and "v1" in out
    assert main(["devices", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 7

    assert main(["send", "cam-01", "get_status"]) == 0
    out = capsys.readouterr().out
    assert "cam-01 get_status: ACCEPTED" in out and "outcome: SUCCEEDED" in out
    assert main(["send", "cam-01", "rollback", '{"to_version": 9}']) == 1
    assert "outcome: FAILED" in capsys.readouterr().out
    assert main(["send", "cam-01", "rollback", "{bad"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["send", "cam-01", "deploy_bundle", json.dumps({"url": URL_V2}), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [ln["update"]["status"] for ln in lines[:-1]] == ["ACCEPTED", "IN_PROGRESS", "SUCCEEDED"]
    assert lines[-1]["outcome"]["status"] == "SUCCEEDED"

    rc = main(["deploy", "https://b.example/bundle-v3.tar", "--devices", "cam-0[0-5]", "--canary", "20%",
               "--wave-size", "2", "--pause", "0", "--max-failure-ratio", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "wave 0 (canary, 2 devices): cam-00,cam-01" in out and "OK in" in out
    assert "6 succeeded, 0 failed" in out

    rc = main(["deploy", "https://b.example/bundle-v4.tar", "--devices", "cam-05,cam-06", "--canary", "0",
               "--wave-size", "2", "--max-failure-ratio", "0.4"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "STOP: failure ratio 1/2" in out and "rolling back 1 devices of the stopped wave: cam-05" in out
    assert "rollback cam-05: SUCCEEDED" in out and "STOPPED" in out
    assert sims["cam-05"].active_version == 3

    assert main(["devices", "--fleet", "a/b"]) == 2
    assert "fleet" in capsys.readouterr().err


def test_cli_signing_key_flags(
    cli_env: pytest.MonkeyPatch, sims: SimFleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sims.add(["cam-01"])
    cli_env.delenv("EDGESERVE_FLEET_KEY", raising=False)
    assert main(["send", "cam-01", "get_status"]) == 2  # no key: nothing is sent
    assert "no command key: give --key PATH or set EDGESERVE_FLEET_KEY" in capsys.readouterr().err
    good = write_private(tmp_path / "good.key")
    assert main(["send", "cam-01", "get_status", "--key", str(good)]) == 0
    assert "outcome: SUCCEEDED" in capsys.readouterr().out
    rogue = write_private(tmp_path / "rogue.key", OTHER_KEY)
    assert main(["send", "cam-01", "get_status", "--key", str(rogue)]) == 1
    assert "not a trusted command key" in capsys.readouterr().out
    assert main(["send", "cam-01", "get_status", "--unsigned"]) == 1  # the sim requires signatures
    assert "outcome: REJECTED" in capsys.readouterr().out
    assert main(["send", "cam-01", "get_status", "--unsigned", "--key", str(good)]) == 2
    assert main(["send", "cam-01", "get_status", "--key", str(tmp_path / "missing.key")]) == 2
    assert "command key" in capsys.readouterr().err
    assert sims["cam-01"].verbs() == ["get_status"]  # only the well-signed one ran
    state = json.dumps({"generation": 2, "bundle": {"url": URL_V2}})
    assert main(["desired", "cam-01", state, "--key", str(good)]) == 0
    assert "generation 2 published (signed, retained)" in capsys.readouterr().out
    assert main(["desired", "cam-01", "[1]", "--key", str(good)]) == 2


def test_cli_watch_for_seconds(
    mosquitto: Mosquitto, sims: SimFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    sims.add(["cam-01"])
    assert main(["watch", "--broker", mosquitto.url, "--fleet", FLEET, "--seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "cam-01 state (retained)" in out and "cam-01 health (retained)" in out


def test_cli_unreachable_broker_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from broker import free_port

    assert main(["devices", "--broker", f"mqtt://127.0.0.1:{free_port()}", "--fleet", FLEET]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgeserve fleet: cannot connect") and len(err.splitlines()) == 1


# -- TLS and passwords ------------------------------------------------------------------------------------


def test_tls_with_test_ca_and_client_certificates(mosquitto_tls: Mosquitto) -> None:
    broker = mosquitto_tls
    assert broker.url.startswith("mqtts://") and broker.pki is not None
    fleet = SimFleet(broker.url, FLEET, command_keys=trusted())
    try:
        for device in ("cam-01", "cam-02"):  # each device its own certificate
            fleet.add([device], **broker.client_options(device))
        with manager_for(broker) as manager:
            assert [r["device"] for r in manager.devices()] == ["cam-01", "cam-02"]
            assert manager.send("cam-02", "deploy_bundle", {"url": URL_V2}, 10)["status"] == "SUCCEEDED"
        with manager_for(broker, protocol="3.1.1") as manager:
            assert manager.send("cam-01", "get_status", {}, 5)["status"] == "SUCCEEDED"
        # no client certificate, a certificate from another CA, no CA to check the server: refused
        with pytest.raises(FleetError):
            FleetManager(broker.url, FLEET, ca_file=broker.pki.ca_file, connect_timeout_s=3).connect()
        rogue = broker.pki.rogue("intruder")
        with pytest.raises(FleetError):
            FleetManager(
                broker.url,
                FLEET,
                ca_file=broker.pki.ca_file,
                cert_file=rogue.cert,
                key_file=rogue.key,
                connect_timeout_s=3,
            ).connect()
        good = broker.pki.issue("ops")
        with pytest.raises(FleetError, match="cannot connect"):
            FleetManager(
                broker.url, FLEET, cert_file=good.cert, key_file=good.key, connect_timeout_s=3
            ).connect()
        # plain MQTT to a TLS listener does not get through either
        with pytest.raises(FleetError):
            FleetManager(f"mqtt://127.0.0.1:{broker.port}", FLEET, connect_timeout_s=3).connect()
    finally:
        fleet.stop()


def test_username_password(
    mosquitto_auth: Mosquitto, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    broker = mosquitto_auth
    fleet = SimFleet(broker.url, FLEET, username="dev", password="dev-secret", command_keys=trusted())
    try:
        fleet.add(["cam-01"])
        with FleetManager(
            broker.url, FLEET, username="ops", password="ops-secret", command_key=COMMAND_KEY
        ) as manager:
            assert manager.send("cam-01", "get_status", {}, 5)["status"] == "SUCCEEDED"
        with pytest.raises(FleetError, match="refused"):
            FleetManager(broker.url, FLEET, username="ops", password="wrong", connect_timeout_s=3).connect()
        with pytest.raises(FleetError, match="refused"):
            FleetManager(broker.url, FLEET, connect_timeout_s=3).connect()
        key = str(write_private(tmp_path / "fleet-commands.key"))
        argv = ["send", "cam-01", "get_status", "--broker", broker.url, "--fleet", FLEET, "--key", key]
        assert main([*argv, "--username", "ops", "--password", "ops-secret"]) == 0
        assert main([*argv, "--username", "ops", "--password", "nope"]) == 2
        assert "refused" in capsys.readouterr().err
    finally:
        fleet.stop()
