"""Attacks on the AWS IoT Jobs binding, as someone who can create jobs (or publish on the thing's job
topics) but does not hold the fleet's command key: each job document below is REJECTED with its reason,
nothing of it runs (no install starts, the store is untouched), and the device goes on with the next job.
A real appliance (`[fleet] protocol = "aws-iot-jobs"`), a real Mosquitto, the Jobs simulator."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
from aws_jobs_device import THING, JobsDevice, device_fixture, job_document, store_status
from broker import needs_mosquitto
from fleet_keys import OTHER_KEY

pytestmark = needs_mosquitto()


device = device_fixture("jobs-attacks")


def _deploy(device: JobsDevice, **options: Any) -> dict[str, Any]:
    url = device.fleet.bundle(9).as_uri()
    document: dict[str, Any] = job_document("deploy_bundle", {"url": url}, **options)
    return document


def _swap_verb(document: dict[str, Any], verb: str) -> dict[str, Any]:
    document["edgeserve"]["verb"] = verb
    return document


def _other_device_command(device: JobsDevice) -> dict[str, Any]:
    """A command signed (rightly) for cam-2, filed under cam-1 in the document."""
    document = _deploy(device, thing="cam-2")
    document["edgeserve"]["commands"] = {THING: document["edgeserve"]["commands"]["cam-2"]}
    return document


def _tampered(device: JobsDevice) -> dict[str, Any]:
    document = _deploy(device)
    envelope = document["edgeserve"]["commands"][THING]
    command = json.loads(envelope["command"])
    command["args"]["url"] = "https://evil.example/b.esb"
    envelope["command"] = json.dumps(command)
    return document


Attack = Callable[[JobsDevice], dict[str, Any]]
ATTACKS: dict[str, tuple[Attack, str]] = {
    "unsigned": (lambda d: _deploy(d, signed=False), "unsigned job command refused"),
    "untrusted-key": (lambda d: _deploy(d, key=OTHER_KEY), "not a trusted command key"),
    "other-device": (_other_device_command, "bad signature"),
    "other-verb": (lambda d: _swap_verb(_deploy(d), "rollback"), "bad signature"),
    "tampered": (_tampered, "bad signature"),
    "expired": (lambda d: _deploy(d, lifetime_s=-60), "expired"),
    "too-long-lived": (lambda d: _deploy(d, lifetime_s=40 * 86400), "max_command_lifetime_s"),
    "no-command-for-this-thing": (lambda d: _deploy(d, thing="cam-9"), "no command for thing cam-1"),
    "not-edgeserve": (lambda d: {"operation": "reboot"}, "not an edgeserve job"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_refused_job_documents_are_rejected_and_never_run(device: JobsDevice, attack: str) -> None:
    make, reason = ATTACKS[attack]
    before = store_status(device.fleet)
    device.sim.create_job(f"attack-{attack}", make(device), [THING])
    done = device.sim.wait_status(THING, f"attack-{attack}", {"SUCCEEDED", "FAILED", "REJECTED"})
    assert done.status == "REJECTED", done
    assert reason in done.status_details["reason"], done.status_details
    states = {u["statusDetails"].get("state") for u in done.updates}
    assert states <= {None}, states  # no ACCEPTED, no DOWNLOADING: nothing of it ran
    after = store_status(device.fleet)
    assert after["active_version"] == before["active_version"] and after["history"] == before["history"]
    # the device goes on: a valid job right after is run
    device.sim.create_job(f"after-{attack}", job_document("get_status"), [THING])
    assert device.sim.wait_status(THING, f"after-{attack}", {"SUCCEEDED", "FAILED"}).status == "SUCCEEDED"
