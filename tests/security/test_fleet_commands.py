"""Attacks on the fleet command channel, as someone who can publish on the broker would make them, against
a real `edgeserve run` (supervisor + fleet agent) and a real Mosquitto that lets anyone publish anywhere.

Every refusal is checked twice: the answer (REJECTED with the reason, where answers go) and that nothing
ran (no ACCEPTED, no ledger entry, no settings written, no restart, no install).
"""

from __future__ import annotations

import base64
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from appliance import Appliance, start_appliance, wait_until
from broker import Mosquitto, Spy, needs_mosquitto
from commander import Commander, stamp
from fleet_keys import COMMAND_KEY, OTHER_KEY, public_pem, trust, write_private
from ota_fixtures import Fleet, edgeserve, make_fleet, status

from edgeserve.fleet.fleet_cli import main as fleet_main
from edgeserve.ota.signing import load_private

pytestmark = needs_mosquitto()

SET_DEBUG = {"logging": {"level": "DEBUG"}}


@dataclass
class Rig:
    broker: Mosquitto
    fleet: Fleet
    device: Appliance
    manager: Commander
    keys: Path

    @property
    def ledger(self) -> dict[str, Any]:
        path = self.fleet.state / "fleet" / "commands.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    def log(self) -> str:
        return self.device.log_path.read_text(errors="replace")


def start_device(broker: Mosquitto, state: Path, tmp: Path, device_id: str, fleet_extra: str) -> Appliance:
    (tmp / "empty").mkdir(parents=True, exist_ok=True)
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "lab"\ndevice_id = "{device_id}"\n'
        f"metrics_interval_s = 1.0\n{fleet_extra}[ota]\ntrial_window_s = 1.0\n"
        "allow_file_urls = true\n"  # the test bundles are local files
    )
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    app.notify.wait_for("READY", timeout=90)
    return app


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("fleet-commands")
    broker = Mosquitto(tmp / "broker").start()
    fleet = make_fleet(tmp)  # the bundle key is trusted for bundles (state/trust/fleet.pub) only
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    keys = trust(tmp / "command-keys")
    # Two PEM blocks in one file: ignored with a warning, so OTHER_KEY stays untrusted.
    (keys / "two-blocks.pub").write_bytes(public_pem(OTHER_KEY) + public_pem(COMMAND_KEY))
    device = start_device(broker, fleet.state, tmp, "cam-1", f'command_keys = "{keys}"\n')
    manager = Commander("127.0.0.1", broker.port, "lab", "cam-1")
    try:
        manager.wait_on("state", lambda b: b.get("online") is True)
        yield Rig(broker, fleet, device, manager, keys)
    finally:
        manager.close()
        device.stop()
        broker.kill()


def refused(rig: Rig, cmd_id: str, reason: str) -> dict[str, Any]:
    """The answer to `cmd_id` is one REJECTED naming `reason`, and the command left no trace."""
    answer = rig.manager.wait(cmd_id, timeout_s=30)
    assert answer["status"] == "REJECTED" and reason in answer["error"], answer
    assert [a["status"] for a in rig.manager.all_answers(cmd_id)] == ["REJECTED"]  # never ACCEPTED
    assert cmd_id not in rig.ledger  # a long command is recorded before it runs: it never did
    assert not (rig.fleet.state / "fleet" / "settings.toml").exists()  # set_config never applied
    return answer


def command_text(cmd_id: str, args: dict[str, Any] | None = None) -> str:
    now = datetime.now(timezone.utc)
    expires = now + timedelta(seconds=120)
    return json.dumps(
        {"cmd_id": cmd_id, "issued_at": stamp(now), "expires_at": stamp(expires), "args": args or {}}
    )


# -- commands -------------------------------------------------------------------------------------------


def test_unsigned_command_is_refused_and_not_run(rig: Rig) -> None:
    cmd_id = rig.manager.send("set_config", SET_DEBUG, unsigned=True)
    refused(rig, cmd_id, "unsigned command refused")
    before = rig.device.server_pid()
    cmd_id = rig.manager.send("restart_runtime", unsigned=True)
    refused(rig, cmd_id, "unsigned command refused")
    assert rig.device.server_pid() == before


def test_signature_by_an_untrusted_key_or_by_the_bundle_key_is_refused(rig: Rig) -> None:
    refused(rig, rig.manager.send("set_config", SET_DEBUG, key=OTHER_KEY), "not a trusted command key")
    # The bundle signing key is trusted for bundles on this very device, not for commands.
    assert (rig.fleet.state / "trust" / "fleet.pub").exists()
    bundle_key = load_private(rig.fleet.key)
    refused(rig, rig.manager.send("set_config", SET_DEBUG, key=bundle_key), "not a trusted command key")
    # OTHER_KEY's .pub sits in the command_keys folder inside a two-block file: ignored, said so in the log.
    assert re.search(r"command key \S*two-blocks\.pub ignored: not exactly one PEM public key", rig.log())


def test_a_valid_envelope_replayed_on_another_topic_is_refused(rig: Rig) -> None:
    manager = rig.manager
    # Signed for another device (cam-2), published on this one's topic.
    other_device = "es/v1/lab/cam-2/cmd/set_config"
    cmd_id = manager.send("set_config", SET_DEBUG, signed_for=other_device)
    refused(rig, cmd_id, "bad signature")
    # The exact bytes of a valid get_status envelope, replayed on this device's restart_runtime topic.
    envelope = manager.wrap(f"{manager.base}/cmd/get_status", command_text("replay-1"))
    before = rig.device.server_pid()
    manager.send("restart_runtime", raw=envelope, cmd_id="replay-1")
    refused(rig, "replay-1", "signed for another device or verb")
    assert rig.device.server_pid() == before
    # The same bytes on the topic they were signed for: the envelope itself was good.
    manager.answers.pop("replay-1")
    manager.send("get_status", raw=envelope, cmd_id="replay-1")
    assert manager.wait("replay-1")["status"] == "SUCCEEDED"


def test_expired_overlong_and_future_commands_are_refused(rig: Rig) -> None:
    manager = rig.manager
    refused(rig, manager.send("set_config", SET_DEBUG, expires_in_s=-5), "expired")
    ten_years = 10 * 365 * 86400
    refused(rig, manager.send("set_config", SET_DEBUG, expires_in_s=ten_years), "max_command_lifetime_s")
    future = manager.send("set_config", SET_DEBUG, issued_in_s=ten_years, expires_in_s=60)
    refused(rig, future, "in the future")
    # The limit itself is allowed (86400 s by default).
    assert manager.wait(manager.send("get_status", expires_in_s=86400))["status"] == "SUCCEEDED"


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda e: {k: v for k, v in e.items() if k != "sig"}, "malformed signed command: fields"),
        (lambda e: {**e, "extra": 1}, "malformed signed command: fields"),
        (lambda e: {**e, "v": 2}, "envelope version"),
        (lambda e: {**e, "v": True}, "envelope version"),
        (lambda e: {**e, "sig": "not base64!"}, "sig is not base64"),
        (
            lambda e: {**e, "sig": base64.b64encode(base64.b64decode(e["sig"])[:62]).decode()},
            "sig is 62 bytes",
        ),
        (lambda e: {**e, "key_id": e["key_id"].upper()}, "key_id is not 16 lowercase hex"),
        (lambda e: {**e, "command": json.loads(e["command"])}, "command is not a string"),
        (lambda e: {**e, "command": e["command"].replace("DEBUG", "ERROR")}, "bad signature"),
    ],
)
def test_malformed_or_altered_envelopes_are_refused(rig: Rig, tamper: Any, reason: str) -> None:
    refused(rig, rig.manager.send("set_config", SET_DEBUG, tamper=tamper), reason)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe not json", "unsigned command refused"),
        (b"[" * 100_000, "unsigned command refused"),  # deeper than the JSON parser goes
        (json.dumps({"sig": 1}).encode(), "malformed signed command"),
    ],
)
def test_garbage_is_refused_on_the_inbox_with_its_correlation(rig: Rig, raw: bytes, reason: str) -> None:
    cmd_id = rig.manager.send("set_config", raw=raw)  # no readable cmd_id: the CorrelationData says which
    assert refused(rig, cmd_id, reason)["cmd_id"] is None


def test_response_topic_outside_the_manager_inboxes_is_ignored(rig: Rig) -> None:
    manager = rig.manager
    foreign = "es/v1/lab/cam-2/cmd/rollback"  # another device's command topic
    spy = Spy(rig.broker, "es/v1/lab/cam-2/#", "es/v1/other/#", "elsewhere/#", "es/v1/lab/manager/a/#")
    try:
        for target in (foreign, "es/v1/other/manager/ops/resp", "elsewhere/x", "es/v1/lab/manager/a/b/resp"):
            ok = manager.send("get_status", response_topic=target)
            answer = manager.wait(ok)
            assert answer["status"] == "SUCCEEDED"
            assert any(t == f"{manager.base}/resp/{ok}" for t, _, _ in manager.messages)  # its own resp/
            bad = manager.send("set_config", SET_DEBUG, unsigned=True, response_topic=target)
            refused(rig, bad, "unsigned")
        # A refusal and a success later, the device has published nothing outside its own prefix.
        manager.wait(manager.send("get_status"))
        assert spy.messages == []
    finally:
        spy.close()
    assert re.search(r"ResponseTopic 'es/v1/lab/cam-2/cmd/rollback' ignored", rig.log())


def test_untrusted_text_is_escaped_and_capped_in_the_log(rig: Rig) -> None:
    evil = "evil\nFORGED-LOG-LINE edgeserve: all good\x1b[31m" + "x" * 5000
    refused(rig, rig.manager.send("set_config", SET_DEBUG, cmd_id=evil), "cmd_id")
    unsigned = evil.replace("evil", "unsigned", 1)
    refused(rig, rig.manager.send("set_config", SET_DEBUG, cmd_id=unsigned, unsigned=True), "unsigned")
    # Brokers refuse control characters in topics (MQTT 5 1.5.4), not a bidi override that flips the line.
    flipped = "es/v1/lab/cam-1/cmd/format_disk\u202eFORGED-LOG-LINE"
    refused(rig, rig.manager.send("format_disk", to=flipped, cmd_id="verb-1"), "unknown verb")
    wait_until(lambda: rig.log().count("FORGED-LOG-LINE") >= 3, 10, "the refusals in the log")
    log = rig.log()
    assert not any(line.startswith("FORGED-LOG-LINE") for line in log.splitlines())
    assert "\x1b" not in log and "\u202e" not in log
    assert "evil\\nFORGED-LOG-LINE" in log  # escaped, still readable
    assert max(len(run) for run in re.findall("x+", log)) < 200  # capped, the length named instead
    assert f"…({len(evil)} chars)" in log


# -- desired states -----------------------------------------------------------------------------------


def test_desired_states_must_be_signed_for_the_device(rig: Rig, tmp_path: Path) -> None:
    manager = rig.manager
    url = rig.fleet.bundle(2).as_uri()

    def rejected(reason: str) -> None:
        body = manager.wait_on(
            "reported", lambda b: reason in ((b.get("desired_rejected") or {}).get("error") or "")
        )
        assert body["desired_rejected"]["status"] == "REJECTED" and body["generation"] == 0

    manager.set_desired({"generation": 99, "bundle": {"url": url}}, unsigned=True)
    rejected("unsigned desired state refused")
    manager.set_desired({"generation": 98, "bundle": {"url": url}}, key=OTHER_KEY)
    rejected("not a trusted command key")
    wrong_topic = manager.wrap(
        "es/v1/lab/cam-2/desired", json.dumps({"generation": 97, "bundle": {"url": url}})
    )
    manager.client.publish(f"{manager.base}/desired", wrong_topic, qos=1, retain=True).wait_for_publish(5)
    rejected("bad signature")
    assert status(rig.fleet.state)["active_version"] == 1  # nothing was installed
    # Signed with the command key by the fleet tool itself: applied.
    key = write_private(tmp_path / "fleet-commands.key")
    state = json.dumps({"generation": 5, "bundle": {"url": url}})
    argv = ["desired", "cam-1", state, "--key", str(key), "--broker", rig.broker.url, "--fleet", "lab"]
    assert fleet_main(argv) == 0
    applied = lambda b: b.get("generation") == 5 and b.get("active_version") == 2  # noqa: E731
    reported = manager.wait_on("reported", applied, timeout_s=120)
    assert reported["desired_rejected"] is None and reported["generation_outcome"] == "applied"
    manager.set_desired(None)


# -- the legitimate path ------------------------------------------------------------------------------


def test_fleet_send_with_key_against_the_real_agent(
    rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["send", "cam-1", "get_status", "--broker", rig.broker.url, "--fleet", "lab"]
    assert fleet_main([*argv, "--key", str(write_private(tmp_path / "ops.key"))]) == 0
    assert "outcome: SUCCEEDED" in capsys.readouterr().out
    assert fleet_main([*argv, "--unsigned"]) == 1
    assert "unsigned command refused" in capsys.readouterr().out
    assert fleet_main([*argv, "--key", str(write_private(tmp_path / "rogue.key", OTHER_KEY))]) == 1
    assert "not a trusted command key" in capsys.readouterr().out


def test_lab_opt_out_runs_unsigned_but_still_verifies_signed(rig: Rig, tmp_path: Path) -> None:
    state = tmp_path / "lab-state"
    state.mkdir()
    device = start_device(rig.broker, state, tmp_path, "cam-lab", "require_signed_commands = false\n")
    manager = Commander("127.0.0.1", rig.broker.port, "lab", "cam-lab")
    try:
        assert manager.wait(manager.send("get_status", unsigned=True))["status"] == "SUCCEEDED"
        forged = manager.wait(manager.send("get_status", key=OTHER_KEY))
        assert forged["status"] == "REJECTED" and "no trusted command key" in forged["error"]
        overlong = manager.wait(manager.send("get_status", unsigned=True, expires_in_s=10 * 365 * 86400))
        assert overlong["status"] == "REJECTED" and "max_command_lifetime_s" in overlong["error"]
        log = device.log_path.read_text()
        assert "require_signed_commands = false: UNSIGNED commands are run" in log
    finally:
        manager.close()
        device.stop()
