"""Shared by tests/security/test_fleet_limits.py, test_fleet_ledger_mqtt.py and test_trust_store.py: a device
(`edgeserve run` with the fleet agent) on a real Mosquitto, whose state folder trusts the keys the test
chooses, laid out as `<state>/trust/bundles/` and `<state>/trust/commands/`."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "fleet"), str(TESTS / "ota"), str(TESTS / "supervisor")]

import fleet_keys  # noqa: E402
from appliance import Appliance, start_appliance  # noqa: E402
from broker import Mosquitto, find_mosquitto, needs_mosquitto  # noqa: E402
from commander import Commander  # noqa: E402
from ota_fixtures import Fleet, edgeserve  # noqa: E402

from edgeserve.ota.signing import keygen  # noqa: E402
from edgeserve.settings_tools import OVERLAY  # noqa: E402

__all__ = ["Appliance", "Commander", "Fleet", "Mosquitto", "edgeserve", "find_mosquitto", "needs_mosquitto"]
FLEET, DEVICE = "lab", "cam-1"


def signer(tmp: Path, name: str, state: Path) -> Fleet:
    """A signing key (not yet trusted anywhere) that builds bundles for the device state `state`."""
    private, public, _ = keygen(tmp / "keys", name)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    return Fleet(tmp / name, private, public, state)


def key_id_of(fleet: Fleet) -> str:
    from edgeserve.ota.signing import key_id, load_public

    return key_id(load_public(fleet.public))


def trust(fleet: Fleet, role_folder: str) -> Path:
    """Put the signer's public key in `<state>/trust/<role_folder>/` (bundles or commands)."""
    folder = fleet.state / "trust" / role_folder
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(fleet.public, folder / f"{fleet.public.stem}.pub"))


def install_offline(fleet: Fleet, version: int, **bundle: object) -> None:
    """`edgeserve bundle install` as an operator runs it before the first start."""
    path = fleet.bundle(version, **bundle)  # type: ignore[arg-type]
    edgeserve("bundle", "install", str(path), "--state-dir", str(fleet.state), check=True)


def start_device(broker: Mosquitto, state: Path, tmp: Path, extra: str = "") -> Appliance:
    """`edgeserve run` serving the state folder's bundle, its agent on `broker` as lab/cam-1."""
    (tmp / "empty").mkdir(parents=True, exist_ok=True)
    fleet_keys.trust(state / "trust" / "commands")  # the Commander signs with the test command key
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "{FLEET}"\ndevice_id = "{DEVICE}"\n'
        "metrics_interval_s = 1.0\n[ota]\ntrial_window_s = 1.0\nallow_file_urls = true\n"
        f"[supervisor]\nrestart_initial_s = 0.2\n{extra}"
    )
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    app.notify.wait_for("READY", timeout=90)
    return app


def manager_for(broker: Mosquitto) -> Commander:
    return Commander("127.0.0.1", broker.port, FLEET, DEVICE)


def publish_desired(manager: Commander, body: dict[str, object] | bytes) -> None:
    """The manager's retained desired state (as tests/fleet/test_device_agent.py publishes it; once
    desired states are signed, this is the one place that signs them)."""
    if isinstance(body, bytes):  # raw bytes as they are (b"" clears the retained state)
        manager.client.publish(f"{manager.base}/desired", body, qos=1, retain=True).wait_for_publish(5)
    else:
        manager.set_desired(body)  # signed for the desired topic with the test command key


@dataclass
class Lab:
    """A device with one installed bundle on a real broker, and a fleet manager talking to it."""

    broker: Mosquitto
    device: Appliance
    manager: Commander
    state: Path

    def overlay(self) -> str | None:
        path = self.state / OVERLAY
        return path.read_text() if path.exists() else None

    def ledger(self) -> dict[str, Any]:
        path = self.state / "fleet" / "commands.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}


@contextmanager
def running_lab(tmp: Path) -> Iterator[Lab]:
    broker = Mosquitto(tmp / "broker").start()
    state = tmp / "state"
    fleet = signer(tmp, "fleet", state)
    trust(fleet, "bundles")
    install_offline(fleet, 1)
    device = start_device(broker, state, tmp)
    manager = manager_for(broker)
    try:
        yield Lab(broker, device, manager, state)
    finally:
        manager.close()
        device.stop()
        broker.kill()
