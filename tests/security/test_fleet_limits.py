"""What a fleet command may change, tried as an attacker with broker access would: a real device
(`edgeserve run` + its fleet agent) on a real Mosquitto.

- set_config of a listener, a credential, an access rule, a path, the [fleet] or [ota] section is
  REJECTED with every refused key named, and nothing is persisted or applied;
- the allowlisted settings are applied and persisted;
- a desired state with a generation that is not an integer from 0 to 2**53-1 is refused and does not
  pin the device: the next sane generation still applies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from cmdlimits_helpers import (
    Lab,
    needs_mosquitto,
    publish_desired,
    running_lab,
)

pytestmark = [
    needs_mosquitto(),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with running_lab(tmp_path_factory.mktemp("fleet-limits")) as running:
        yield running


FORBIDDEN: list[tuple[str, dict[str, dict[str, Any]]]] = [
    ("http-on-every-interface", {"http": {"host": "0.0.0.0"}}),
    ("grpc-host-and-port", {"grpc": {"host": "0.0.0.0", "port": 18001}}),
    ("zmq-over-tcp", {"zmq": {"endpoints": ["tcp://0.0.0.0:5555"]}}),
    ("http-off", {"http": {"enabled": False}}),
    ("tls-files", {"grpc": {"tls_cert": "/tmp/cert.pem", "tls_key": "/tmp/key.pem"}}),
    ("token-removed", {"grpc": {"token": ""}}),
    ("admin-from-anywhere", {"grpc": {"admin_loopback_only": False}}),
    ("client-shm-any-key", {"shm": {"allow_client_shm": True, "key_prefixes": []}}),
    ("model-control", {"server": {"model_control_mode": "none"}}),
    ("log-file-in-trust-folder", {"logging": {"file": "{state}/trust/bundles/audit.pub"}}),
    ("repository-path", {"server": {"model_repository": "/"}}),
    ("probe-paths", {"runtime": {"hardware_root": "/tmp", "device_profiles": "/tmp"}}),
    ("fleet-broker", {"fleet": {"broker": "mqtt://evil.example:1883"}}),
    ("fleet-metrics", {"fleet": {"metrics_interval_s": 0.01}}),
    ("ota-trust-dir", {"ota": {"trust_dir": "/tmp/evil-trust"}}),
    ("unknown-section", {"nosuch": {"x": 1}}),
]


@pytest.mark.parametrize("changes", [c for _, c in FORBIDDEN], ids=[n for n, _ in FORBIDDEN])
def test_set_config_of_a_forbidden_setting_is_rejected_and_nothing_persists(
    lab: Lab, changes: dict[str, dict[str, Any]]
) -> None:
    changes = json.loads(json.dumps(changes).replace("{state}", str(lab.state)))
    before = lab.overlay()
    cmd_id = lab.manager.send("set_config", changes)
    answer = lab.manager.wait(cmd_id)
    assert answer["status"] == "REJECTED", answer
    for section, values in changes.items():
        for key in values:
            assert f"{section}.{key} (" in answer["error"], answer["error"]
    assert "nothing was applied" in answer["error"]
    assert lab.overlay() == before  # nothing persisted
    assert cmd_id not in lab.ledger()  # refused before it was accepted: it never ran
    assert not (lab.state / "trust" / "bundles" / "audit.pub").exists()
    assert lab.device.get("/v2/health/ready") == 200


def test_one_forbidden_key_refuses_the_whole_command(lab: Lab) -> None:
    before = lab.overlay()
    changes = {
        "logging": {"level": "DEBUG", "file": "/tmp/edgeserve.log"},
        "http": {"host": "0.0.0.0", "max_connections": 10},
        "grpc": {"admin_loopback_only": False},
    }
    answer = lab.manager.wait(lab.manager.send("set_config", changes))
    assert answer["status"] == "REJECTED", answer
    named = [part.split(" (")[0] for part in answer["error"].split(": ", 1)[1].split("; ")[:-1]]
    assert named == ["grpc.admin_loopback_only", "http.host", "logging.file"], answer["error"]
    assert lab.overlay() == before  # the allowed logging.level and http.max_connections were not applied


@pytest.mark.parametrize("generation", [10**30, -1, "5", 1.5, True], ids=repr)
def test_a_desired_generation_out_of_range_is_refused(lab: Lab, generation: object) -> None:
    applied = lab.state / "fleet" / "applied.json"
    before = applied.read_text() if applied.exists() else None
    publish_desired(lab.manager, {"generation": generation, "bundle": {"url": "https://fleet.example/b.esb"}})
    expected = f"desired generation {generation!r} is not an integer from 0 to {2**53 - 1}"
    reported = lab.manager.wait_on(
        "reported", lambda body: (body.get("desired_rejected") or {}).get("error") == expected
    )
    assert reported["generation"] == (json.loads(before)["generation"] if before else 0)
    assert (applied.read_text() if applied.exists() else None) == before  # not pinned


def test_a_sane_generation_still_applies_after_refused_ones(lab: Lab) -> None:
    publish_desired(lab.manager, {"generation": 10**30})
    lab.manager.wait_on(
        "reported", lambda body: "10000000000000" in (body.get("desired_rejected") or {}).get("error", "")
    )
    publish_desired(lab.manager, {"generation": 3})  # no bundle: the generation is recorded only
    lab.manager.wait_on("reported", lambda b: b.get("generation") == 3 and b.get("desired_rejected") is None)
    assert json.loads((lab.state / "fleet" / "applied.json").read_text())["generation"] == 3
    publish_desired(lab.manager, b"")  # clear the retained state


def test_the_allowlisted_settings_apply_and_persist(lab: Lab) -> None:
    changes = {
        "logging": {"level": "DEBUG"},
        "http": {"max_connections": 100},
        "server": {"max_inflight": 64},
    }
    answer = lab.manager.wait(lab.manager.send("set_config", changes))
    assert answer["status"] == "SUCCEEDED", answer
    overlay = lab.overlay() or ""
    assert (
        'level = "DEBUG"' in overlay and "max_connections = 100" in overlay and "max_inflight = 64" in overlay
    )
    assert sorted(answer["result"]["restarted_for"]) == ["http.max_connections", "server.max_inflight"]
    lab.device.wait_ready(timeout=90)
