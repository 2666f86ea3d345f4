"""`deploy_bundle` over MQTT, as whoever can publish a command would send it, against a real appliance
with the default `[ota]` settings: the device refuses to fetch its own files, its own loopback (its own
HTTP API included) and the cloud metadata address, answers FAILED with the reason, keeps nothing and
keeps serving what it served. A deploy from a LAN mirror still installs.

(These commands are published unsigned, as the device agent of this branch accepts them; once commands
must be signed, the Commander signs them like the other fleet tests.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bundle_helpers import (
    Appliance,
    Mosquitto,
    downloads,
    fleet_keys,
    lan_address,
    needs_mosquitto,
    start_appliance,
)
from bundle_server import BundleServer
from commander import Commander
from ota_fixtures import Fleet, edgeserve, make_fleet, status

pytestmark = needs_mosquitto()


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Fleet, Mosquitto]]:
    tmp = tmp_path_factory.mktemp("device")
    broker = Mosquitto(tmp / "broker").start()
    fleet = make_fleet(tmp)
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    (tmp / "empty").mkdir()
    fleet_keys.trust(fleet.state / "trust" / "commands")  # the Commander signs with the test command key
    config = (
        f'[fleet]\nbroker = "{broker.url}"\nfleet = "lab"\ndevice_id = "cam-1"\n'
        "[ota]\ntrial_window_s = 1.0\n"  # nothing else: the URL rules are the defaults
    )
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(fleet.state)], config=config,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    try:
        app.notify.wait_for("READY", timeout=60)
        yield app, fleet, broker
    finally:
        app.stop()
        broker.kill()


@pytest.fixture
def manager(device: tuple[Appliance, Fleet, Mosquitto]) -> Iterator[Commander]:
    commander = Commander("127.0.0.1", device[2].port, "lab", "cam-1")
    yield commander
    commander.close()


def test_deploy_bundle_cannot_fetch_local_files_loopback_or_metadata(
    device: tuple[Appliance, Fleet, Mosquitto], manager: Commander
) -> None:
    app, fleet, _ = device
    good = fleet.bundle(2)
    with BundleServer() as server:
        url = server.add("/v2.esb", good.read_bytes())
        port = server.port
        attempts = {
            good.as_uri(): "allow_file_urls",
            "file:///etc/shadow": "allow_file_urls",
            url: "127.0.0.1 is a loopback address",
            f"http://localhost:{port}/v2.esb": "localhost resolves to",
            f"http://[::ffff:127.0.0.1]:{port}/v2.esb": "IPv4 127.0.0.1 inside an IPv6 address",
            f"http://0.0.0.0:{port}/v2.esb": "0.0.0.0 is in 0.0.0.0/8",
            f"http://127.0.0.1:{app.http_port}/v2/models/stats": "127.0.0.1 is a loopback address",
            "http://169.254.169.254/latest/meta-data/": "the cloud metadata service",
        }
        for target, words in attempts.items():
            final = manager.wait(manager.send("deploy_bundle", {"url": target}))
            assert final["status"] == "FAILED", final
            assert final["error"].startswith("refused: url: ") and words in final["error"], final["error"]
        assert server.requests() == []  # the device never connected
    assert downloads(fleet.state) == []
    info = status(fleet.state)
    assert info["active"] == "vision v1" and info["installed"] == {"vision": 1}
    assert app.get("/v2/health/ready") == 200


def test_deploy_bundle_from_a_lan_mirror_installs(
    device: tuple[Appliance, Fleet, Mosquitto], manager: Commander
) -> None:
    app, fleet, _ = device
    lan = lan_address()
    if lan is None:
        pytest.skip("this machine has no LAN (non-loopback, non-link-local) IPv4 address to serve from")
    with BundleServer(host=lan) as mirror:
        url = mirror.add("/v2.esb", fleet.bundle(2).read_bytes())
        final = manager.wait(manager.send("deploy_bundle", {"url": url}))
    assert final["status"] == "SUCCEEDED" and final["result"]["version"] == 2, final
    assert status(fleet.state)["active"] == "vision v2" and downloads(fleet.state) == []
    assert app.get("/v2/health/ready") == 200
