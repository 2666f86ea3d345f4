"""Attacks on the AWS IoT Jobs binding that need no key, as someone who can create jobs would make them,
and what the device costs the service: a real appliance (`[fleet] protocol = "aws-iot-jobs"`), a real
Mosquitto and the Jobs simulator (tests/fleet/aws_jobs_sim.py).

- a flood of refused (unsigned) jobs does not flush the command ledger: the signed command it was meant
  to push out, put in a new job, is answered with its first outcome and not run again;
- a document nested 2000 levels deep is REJECTED with the reason and the next job runs, also when the
  device starts with it queued;
- once the service cancelled a job, the device sends no status for it (each refused update is a billed
  message), and it never asks about a job it just finished itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
from aws_jobs_device import THING, JobsDevice, device_fixture, job_document, store_status
from aws_jobs_sim import RawDocument
from broker import needs_mosquitto
from bundle_server import BundleServer

pytestmark = [needs_mosquitto(), pytest.mark.timeout(600)]

FINAL = {"SUCCEEDED", "FAILED", "REJECTED"}
FLOOD = 1001  # one more than the 1000 entries the ledger used to keep, oldest forgotten first
# 2000 levels in 4 KB: deeper than Python's json goes (its recursion limit is 1000)
DEEP = RawDocument('{"edgeserve": ' + "[" * 2000 + "]" * 2000 + "}")

device = device_fixture("jobs-robustness")


def _installs(device: JobsDevice, version: int) -> int:
    return sum(1 for h in store_status(device.fleet)["history"] if h.get("version") == version)


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.05)


def test_a_flood_of_refused_jobs_does_not_flush_the_ledger(device: JobsDevice) -> None:
    version = int(store_status(device.fleet)["active_version"]) + 1
    signed = job_document("deploy_bundle", {"url": device.fleet.bundle(version).as_uri()})
    device.sim.create_job("real-deploy", signed, [THING])
    assert device.sim.wait_status(THING, "real-deploy", FINAL).status == "SUCCEEDED"
    assert _installs(device, version) == 1
    # Each refused job costs its sender nothing; the device once kept them in the same 1000-entry ledger
    # as the commands it ran, oldest forgotten first.
    for number in range(FLOOD):
        device.sim.create_job(f"flood-{number}", job_document("get_status", signed=False), [THING])
    last = device.sim.wait_status(THING, f"flood-{FLOOD - 1}", FINAL, timeout=300)
    assert last.status == "REJECTED" and "unsigned" in last.status_details["reason"], last
    assert {device.sim.execution(THING, f"flood-{n}").status for n in range(FLOOD)} == {"REJECTED"}
    # The captured signed command, in a job of its own: its first outcome, not a second install.
    device.sim.create_job("replayed-deploy", signed, [THING])
    again = device.sim.wait_status(THING, "replayed-deploy", FINAL)
    assert again.status == "SUCCEEDED" and again.status_details.get("duplicate") == "true", again
    assert _installs(device, version) == 1
    assert {u["statusDetails"].get("state") for u in again.updates} <= {None}  # nothing of it ran


def test_a_document_nested_2000_deep_is_rejected_and_the_next_job_runs(device: JobsDevice) -> None:
    before = store_status(device.fleet)
    device.sim.create_job("deep", DEEP, [THING])
    device.sim.create_job("after-deep", job_document("get_status"), [THING])
    deep = device.sim.wait_status(THING, "deep", FINAL)
    assert deep.status == "REJECTED" and "nested" in deep.status_details["reason"], deep
    assert device.sim.wait_status(THING, "after-deep", FINAL).status == "SUCCEEDED"
    assert store_status(device.fleet)["history"] == before["history"]


def test_a_cancelled_job_is_told_nothing_more(device: JobsDevice) -> None:
    active = store_status(device.fleet)["active_version"]
    server = BundleServer().start()
    try:
        data = device.fleet.bundle(active + 1).read_bytes()
        slow = server.add("/cancel-me.esb", data, stall_after=1000, stall_s=6, times=1)
        device.sim.create_job("cancel-me", job_document("deploy_bundle", {"url": slow}), [THING])
        device.sim.create_job("after-cancel", job_document("get_status"), [THING])

        def downloading() -> bool:
            updates = device.sim.execution(THING, "cancel-me").updates
            return any(u["statusDetails"].get("state") == "DOWNLOADING" for u in updates)

        _wait(downloading, 90, "the device did not report DOWNLOADING")  # the download now stalls
        sent_before = len(device.sim.execution(THING, "cancel-me").updates)
        device.sim.cancel(THING, "cancel-me")
        assert device.sim.wait_status(THING, "after-cancel", FINAL).status == "SUCCEEDED"
    finally:
        server.stop()
    late = device.sim.execution(THING, "cancel-me").updates[sent_before:]
    # A progress tick already under way when the service cancelled may be refused (that is how a device
    # can learn it); a final status never goes out, nor anything after the refusal.
    assert [u["status"] for u in late] in ([], ["IN_PROGRESS"]), late
    assert device.sim.execution(THING, "cancel-me").status == "CANCELED"
    assert store_status(device.fleet)["active_version"] == active


def test_the_device_asks_nothing_about_jobs_it_finished(device: JobsDevice) -> None:
    asked_before = len(device.sim.queries)
    burst = [f"burst-{n}" for n in range(8)]
    for job_id in burst:
        device.sim.create_job(job_id, job_document("get_status"), [THING])
    for job_id in burst:
        assert device.sim.wait_status(THING, job_id, FINAL).status == "SUCCEEDED"
    asked = device.sim.queries[asked_before:]
    # DescribeJobExecution is a billed message: none about a job the device itself just ended, and no
    # $next query (the device asks that once per connection; notify-next says the rest).
    assert [q for q in asked if q[1] in FINAL or q[0] == "$next"] == [], asked


def test_a_deep_document_queued_while_the_device_was_down_is_rejected_at_start(device: JobsDevice) -> None:
    """Last in this module: it restarts the device."""
    device.app.stop()
    device.sim.create_job("deep-at-start", DEEP, [THING])
    device.sim.create_job("after-deep-at-start", job_document("get_status"), [THING])
    device.start()
    try:
        deep = device.sim.wait_status(THING, "deep-at-start", FINAL)
        after = device.sim.wait_status(THING, "after-deep-at-start", FINAL)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{device.logs()}") from None
    assert deep.status == "REJECTED" and "nested" in deep.status_details["reason"], deep
    assert after.status == "SUCCEEDED"
