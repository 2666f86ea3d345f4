"""Issue 23: after a broker restart that lost its retained messages, the agent publishes `info` and
`state` again as soon as it is reconnected, not at the next metrics tick (an hour here)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "ota"), str(HERE.parent / "supervisor")]

from appliance import start_appliance  # noqa: E402
from broker import Mosquitto, needs_mosquitto  # noqa: E402
from commander import Commander  # noqa: E402
from ota_fixtures import edgeserve, make_fleet  # noqa: E402

pytestmark = [
    needs_mosquitto(),
    pytest.mark.timeout(240),
]


def test_info_and_state_are_published_again_at_every_reconnect(tmp_path: Path) -> None:
    fleet = make_fleet(tmp_path)
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    broker = Mosquitto(tmp_path / "broker").start()
    (tmp_path / "empty").mkdir()
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "lab"\ndevice_id = "cam-1"\nmetrics_interval_s = 3600.0\n'
    )
    app = start_appliance(tmp_path / "empty", tmp_path, args=["--state-dir", str(fleet.state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    manager = Commander("127.0.0.1", broker.port, "lab", "cam-1")
    try:
        app.notify.wait_for("READY", timeout=90)
        first = manager.wait_on("info", lambda b: "hardware" in b, timeout_s=60)
        manager.close()
        broker.stop()
        shutil.rmtree(broker.folder / "data")  # the broker comes back without any retained message
        (broker.folder / "data").mkdir()
        broker.start()
        manager = Commander("127.0.0.1", broker.port, "lab", "cam-1")
        info = manager.wait_on("info", lambda b: "hardware" in b, timeout_s=60)
        assert info["boot_id"] == first["boot_id"]  # the same agent, re-sent after its reconnect
        assert manager.wait_on("state", lambda b: b.get("online") is True)["boot_id"] == first["boot_id"]
        assert info["trust"]["bundle_keys"] and info["trust"]["active_signer_revoked"] is False
    finally:
        manager.close()
        app.stop()
        broker.kill()
