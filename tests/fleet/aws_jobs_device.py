"""A real appliance with `[fleet] protocol = "aws-iot-jobs"` against a real Mosquitto and the Jobs
simulator, and job documents made the way an operator's tooling makes them (signed with the test command
key for the device's own `cmd/{verb}` topic). Shared by tests/fleet/test_aws_jobs.py and
tests/security/test_fleet_engines_jobs.py."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance import Appliance, start_appliance
from aws_jobs_sim import JobsSimulator
from broker import Mosquitto
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fleet_keys import COMMAND_KEY, trust
from ota_fixtures import Fleet, edgeserve, make_fleet

from edgeserve.config import OtaSection
from edgeserve.fleet.signed import sign_command

FLEET, THING = "lab", "cam-1"
# The bundles lie on this machine (file:// and the loopback bundle server): allowed explicitly where this
# edgeserve has the URL rules for fleet downloads.
URL_RULES = (
    "allow_file_urls = true\nallow_loopback_urls = true\n" if hasattr(OtaSection(), "allow_file_urls") else ""
)


@dataclass
class JobsDevice:
    broker: Mosquitto
    sim: JobsSimulator
    fleet: Fleet
    app: Appliance
    tmp: Path

    def start(self, env: dict[str, str] | None = None) -> Appliance:
        """(Re)start the appliance on the same state folder and settings."""
        folder = self.tmp / f"run-{len(list(self.tmp.glob('run-*')))}"
        folder.mkdir()
        self.app = start_appliance(self.tmp / "empty", folder, args=["--state-dir", str(self.fleet.state)],
                                   config=self.app.config_path.read_text(),
                                   env={"EDGESERVE_SERVER_STATE_DIR": "", **(env or {})})  # fmt: skip
        self.app.notify.wait_for("READY", timeout=90)
        return self.app

    def logs(self, lines: int = 40) -> str:
        """The tail of every appliance log of this device (for failure messages)."""
        return "\n".join(
            f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in sorted(self.tmp.rglob("appliance-*.log"))
        )

    def close(self) -> None:
        self.app.stop()
        self.sim.close()
        self.broker.kill()


def start_jobs_device(tmp: Path, *, minute_s: float = 1.0) -> JobsDevice:
    """Broker, simulator (a simulated minute lasts `minute_s`), a device serving bundle v1 on AWS IoT Jobs."""
    broker = Mosquitto(tmp / "broker").start()
    sim = JobsSimulator(broker.port, minute_s=minute_s)
    fleet = make_fleet(tmp)
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    trust(fleet.state / "trust" / "commands")
    (tmp / "empty").mkdir(exist_ok=True)
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "{FLEET}"\ndevice_id = "{THING}"\n'
        'protocol = "aws-iot-jobs"\n'
        f"[ota]\ntrial_window_s = 1.0\n{URL_RULES}[supervisor]\nrestart_initial_s = 0.2\n"
    )
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(fleet.state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    app.notify.wait_for("READY", timeout=90)
    return JobsDevice(broker, sim, fleet, app, tmp)


def device_fixture(name: str) -> Any:
    """A test file's module fixture `device` (`device = device_fixture(name)`): a started JobsDevice."""
    import pytest

    @pytest.fixture(scope="module")
    def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobsDevice]:
        started = start_jobs_device(tmp_path_factory.mktemp(name))
        yield started
        started.close()

    return device


def job_document(
    verb: str,
    args: dict[str, Any] | None = None,
    *,
    thing: str = THING,
    key: Ed25519PrivateKey = COMMAND_KEY,
    signed: bool = True,
    signed_for: str | None = None,
    cmd_id: str | None = None,
    step_timeout_min: int | None = None,
    lifetime_s: float = 600,
) -> dict[str, Any]:
    """An edgeserve job document with one command for `thing`, signed for its own cmd/{verb} topic (or for
    `signed_for`), or the bare command when not `signed`."""
    now = datetime.now(timezone.utc)
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    expires = (now + timedelta(seconds=lifetime_s)).strftime(stamp)
    command = {"cmd_id": cmd_id or uuid.uuid4().hex[:12], "issued_at": now.strftime(stamp),
               "expires_at": expires, "args": args or {}}  # fmt: skip
    text = json.dumps(command)
    topic = signed_for or f"es/v1/{FLEET}/{thing}/cmd/{verb}"
    entry: Any = json.loads(sign_command(key, topic, text)) if signed else command
    section: dict[str, Any] = {"verb": verb, "commands": {thing: entry}}
    if step_timeout_min is not None:
        section["step_timeout_min"] = step_timeout_min
    return {"edgeserve": section}


def store_status(fleet: Fleet) -> dict[str, Any]:
    from ota_fixtures import status

    return dict(status(fleet.state))
