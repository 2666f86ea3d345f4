"""The fleet agent on AWS IoT Jobs end to end: a real `edgeserve run` with `[fleet] protocol =
"aws-iot-jobs"`, a real Mosquitto, and a simulator of the Jobs service's documented MQTT contract
(tests/fleet/aws_jobs_sim.py). One device serves the module; each test queues its own jobs. Refused
job documents (unsigned, wrong key, another device's signature) are in
tests/security/test_fleet_engines_jobs.py."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota" / "mender"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
from appliance import wait_until
from aws_jobs_device import THING, JobsDevice, device_fixture, job_document, store_status
from broker import needs_mosquitto
from bundle_server import BundleServer
from fleet_keys import write_private
from mender_env import kill_tree
from ota_fixtures import edgeserve

from edgeserve.config import ConfigError, load_settings
from edgeserve.ota.signing import keygen

pytestmark = needs_mosquitto()


device = device_fixture("aws-jobs")


def _next_version(device: JobsDevice) -> int:
    return int(store_status(device.fleet)["active_version"]) + 1


def _cli_document(tmp: Path, *args: str) -> dict[str, Any]:
    """`edgeserve fleet job-document VERB ARGS --things ...` as an operator runs it."""
    key = write_private(tmp / "commands.key")
    result = edgeserve(
        "fleet", "job-document", *args[:-1], "--fleet", "lab", "--things", args[-1], "--key", str(key)
    )
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_job_document_tool_refuses_what_aws_would(tmp_path: Path) -> None:
    things = ",".join(f"cam-{i}" for i in range(200))
    key = write_private(tmp_path / "commands.key")
    big = edgeserve(
        "fleet", "job-document", "get_status", "--fleet", "lab", "--things", things, "--key", str(key)
    )
    assert big.returncode == 2 and "over AWS IoT's 32 KB: split them into jobs of at most" in big.stderr
    bad = edgeserve("fleet", "job-document", "rollback", '{"to_version": 0}', "--fleet", "lab", "--things",
                    "cam-1", "--key", str(key))  # fmt: skip
    assert bad.returncode == 2 and "to_version must be a positive version" in bad.stderr
    unkeyed = edgeserve("fleet", "job-document", "get_status", "--fleet", "lab", "--things", "cam-1",
                        env={"EDGESERVE_FLEET_KEY": ""})  # fmt: skip
    assert unkeyed.returncode == 2 and "no command key" in unkeyed.stderr


def test_job_deploys_a_bundle_reports_progress_and_succeeds(device: JobsDevice, tmp_path: Path) -> None:
    version = _next_version(device)
    url = device.fleet.bundle(version).as_uri()
    document = _cli_document(tmp_path, "deploy_bundle", json.dumps({"url": url}), f"{THING},cam-2")
    assert set(document["edgeserve"]["commands"]) == {THING, "cam-2"}  # one signed command per thing
    device.sim.create_job(f"deploy-v{version}", document, [THING])
    done = device.sim.wait_status(THING, f"deploy-v{version}", {"SUCCEEDED", "FAILED", "REJECTED"})
    assert done.status == "SUCCEEDED", done
    assert done.status_details["state"] == "COMMITTED" and done.status_details["version"] == str(version)
    assert store_status(device.fleet)["active_version"] == version
    updates = done.updates
    assert updates[0]["status"] == "IN_PROGRESS" and updates[0]["statusDetails"]["state"] == "ACCEPTED"
    assert updates[0]["stepTimeoutInMinutes"] >= 1  # the step timer is set by the device
    states = [u["statusDetails"].get("state") for u in updates if u["status"] == "IN_PROGRESS"]
    assert {"DOWNLOADING", "VERIFYING", "STAGED"} <= set(states), states
    assert any("progress" in u["statusDetails"] for u in updates)
    steps = [u for u in updates if "stepTimeoutInMinutes" in u]
    changes = 1 + sum(1 for before, now in itertools.pairwise(states) if now != before)
    assert len(steps) == changes  # the step timer restarts per new state (a progress tick does not)
    assert all("expectedVersion" in u for u in updates) and done.rejections == []

    # The same signed command in a second job: answered with its first outcome, not run again.
    device.sim.create_job("deploy-again", document, [THING])
    again = device.sim.wait_status(THING, "deploy-again", {"SUCCEEDED", "FAILED", "REJECTED"})
    assert again.status == "SUCCEEDED" and again.status_details["duplicate"] == "true", again
    installs = [h for h in store_status(device.fleet)["history"] if h.get("version") == version]
    assert len(installs) == 1


def test_bad_bundle_fails_with_the_reason(device: JobsDevice, tmp_path: Path) -> None:
    active = store_status(device.fleet)["active_version"]
    stranger, _, _ = keygen(tmp_path / "keys", "stranger")
    other = dataclasses.replace(device.fleet, key=stranger, tmp=tmp_path)
    bundle = other.bundle(active + 1)  # signed by a key the device does not trust
    device.sim.create_job("bad-bundle", job_document("deploy_bundle", {"url": bundle.as_uri()}), [THING])
    done = device.sim.wait_status(THING, "bad-bundle", {"SUCCEEDED", "FAILED", "REJECTED"})
    assert done.status == "FAILED", done
    assert "refused" in done.status_details["reason"] and "key" in done.status_details["reason"]
    assert store_status(device.fleet)["active_version"] == active
    assert store_status(device.fleet)["state"] == "IDLE"


def test_step_timeout_is_honoured(device: JobsDevice, tmp_path: Path) -> None:
    """A step that outlives its timer: the service times the execution out, the device stops the install
    (or undoes it) and goes on with the next job."""
    active = store_status(device.fleet)["active_version"]
    server = BundleServer().start()
    try:
        data = device.fleet.bundle(active + 1).read_bytes()
        slow = server.add("/slow.esb", data, stall_after=1000, stall_s=6, times=1)
        document = job_document("deploy_bundle", {"url": slow}, step_timeout_min=1)  # 1 s here
        device.sim.create_job("slow-deploy", document, [THING])
        device.sim.create_job("status-after", job_document("get_status"), [THING])
        timed_out = device.sim.wait_status(THING, "slow-deploy", {"TIMED_OUT", "SUCCEEDED", "FAILED"})
        assert timed_out.status == "TIMED_OUT", timed_out
        after = device.sim.wait_status(THING, "status-after", {"SUCCEEDED", "FAILED", "REJECTED"})
        assert after.status == "SUCCEEDED", after
        # Once the device knows the service gave up on the job it says nothing more about it (each refused
        # update is a billed message): at most the one update that was under way when the timer ran out is
        # refused, never a final status. The bundle of a job the service gave up on does not serve.
        late = device.sim.wait_status(THING, "slow-deploy", {"TIMED_OUT"})
        assert late.rejections.count("InvalidStateTransition") <= 1, late.rejections
        assert not [u for u in late.refused_updates if u.get("status") != "IN_PROGRESS"], late.refused_updates
        assert store_status(device.fleet)["active_version"] == active
        assert store_status(device.fleet)["state"] == "IDLE"
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["aws-iot-jobs", "5", "3.1.1"])
def test_protocol_setting_accepts_the_jobs_binding(tmp_path: Path, value: str) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text(
        f'[fleet]\nbroker = "mqtts://a1b2c3-ats.iot.eu-west-1.amazonaws.com:8883"\nprotocol = "{value}"\n'
    )
    assert load_settings(path, {}).fleet.protocol == value


def test_protocol_setting_refuses_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text('[fleet]\nprotocol = "aws-jobs"\n')
    with pytest.raises(
        ConfigError, match=r"edgeserve.toml: fleet.protocol: 'aws-jobs' is not 5, 3.1.1 .* aws-iot-jobs"
    ):
        load_settings(path, {})
    assert load_settings(None, {"EDGESERVE_FLEET_PROTOCOL": "aws-iot-jobs"}).fleet.protocol == "aws-iot-jobs"


@pytest.mark.parametrize("thing", ["cam.01", "x" * 129, "cam 01", "cam/01"])
def test_a_thing_name_aws_would_refuse_is_a_config_error(tmp_path: Path, thing: str) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text(f'[fleet]\nprotocol = "aws-iot-jobs"\ndevice_id = "{thing}"\n')
    with pytest.raises(ConfigError, match=r"fleet.device_id: .* is not an AWS IoT thing name: 1-128 letters"):
        load_settings(path, {})
    key = write_private(tmp_path / "commands.key")
    made = edgeserve(
        "fleet", "job-document", "get_status", "--fleet", "lab", "--things", thing, "--key", str(key)
    )
    assert made.returncode == 2 and "AWS IoT's rule, no '.'" in made.stderr, made.stderr


def test_a_thing_name_as_aws_allows_it_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text('[fleet]\nprotocol = "aws-iot-jobs"\ndevice_id = "plant-7:cam_01"\n')
    assert load_settings(path, {}).fleet.device_id == "plant-7:cam_01"
    path.write_text(
        '[fleet]\nprotocol = "5"\ndevice_id = "plant-7:cam_01"\n'
    )  # one es/v1 topic level: no ':'
    with pytest.raises(ConfigError, match="one topic level"):
        load_settings(path, {})
    document = _cli_document(tmp_path, "get_status", "{}", "plant-7:cam_01")
    assert list(document["edgeserve"]["commands"]) == ["plant-7:cam_01"]


def test_device_killed_mid_job_reports_it_failed_after_restart(device: JobsDevice) -> None:
    """Last in this module: it restarts the device. The install under way is undone at start and the
    execution it belonged to ends FAILED (interrupted), never IN_PROGRESS for ever."""
    active = store_status(device.fleet)["active_version"]
    device.app.stop()
    device.start(env={"EDGESERVE_TEST_OTA_HOLD": "LOADING"})
    url = device.fleet.bundle(active + 1).as_uri()
    device.sim.create_job("killed", job_document("deploy_bundle", {"url": url}), [THING])
    held = device.fleet.state / "ota" / "held"
    try:
        wait_until(held.exists, 60, "the install to reach LOADING")
        assert device.sim.execution(THING, "killed").status == "IN_PROGRESS"
        kill_tree(device.app.process.pid)  # supervisor, server, agent: a power cut mid-job
        held.unlink()
        device.start()
        done = device.sim.wait_status(THING, "killed", {"SUCCEEDED", "FAILED", "REJECTED"})
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{device.logs()}") from None
    assert done.status == "FAILED" and "interrupted" in done.status_details["reason"], done
    assert store_status(device.fleet)["active_version"] == active
    assert store_status(device.fleet)["state"] == "IDLE"
