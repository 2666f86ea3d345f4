"""The edgeserve-bundle Update Module through the real Mender client (Debian's mender-client 3.4, standalone
mode: `mender install`, `commit`, `rollback`), on a device state folder that serves bundle v1: install and
commit, roll back, a failed trial, a commit after the bundle stopped serving, another device type, and the
client or the appliance killed -9 mid-install (then recovered). Refused bundles inside valid artifacts are
in tests/security/test_fleet_engines_mender.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "supervisor"))
from mender_env import MenderEnv, fleet_fixture, kill_tree, raw_artifact, unavailable, wait_file, wrap
from ota_fixtures import Fleet, edgeserve, mlp_check, status

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


fleet = fleet_fixture()  # serving vision v1: a copy per test of one install (it costs a trial server)


@pytest.fixture
def env(fleet: Fleet, tmp_path: Path) -> MenderEnv:
    return MenderEnv(tmp_path / "mender", fleet.state)


def _active(fleet: Fleet) -> int | None:
    value = status(fleet.state)["active_version"]
    return value if isinstance(value, int) else None


def _inventory(env: MenderEnv) -> set[str]:
    script = env.root / "usr/share/mender/inventory/mender-inventory-edgeserve"
    result = subprocess.run([str(script)], capture_output=True, text=True, env=env.env(), check=True)
    return set(result.stdout.splitlines())


def _ok(result: object) -> None:
    assert getattr(result, "returncode", 1) == 0, (
        f"{getattr(result, 'stdout', '')}\n{getattr(result, 'stderr', '')}"
    )


def test_install_commit_rollback_and_install_again(env: MenderEnv, fleet: Fleet) -> None:
    factory = env.artifact_name()
    v2 = wrap(fleet.bundle(2))
    installed = env.mender("install", str(v2))
    _ok(installed)
    assert "commit" in installed.stdout  # standalone: the module supports rollback, so it waits for commit
    assert _active(fleet) == 2 and env.artifact_name() == factory  # serving, not yet committed in Mender
    _ok(env.mender("commit"))
    assert env.artifact_name() == "vision-v2"
    provides = env.provides()
    assert provides["edgeserve-bundle.vision.version"] == "2"
    assert provides["edgeserve-bundle.vision.security_version"] == "0"
    assert not (fleet.state / "mender" / "incoming").exists()  # Cleanup ran; the notes stay for the next
    inventory = _inventory(env)
    assert {"edgeserve_bundle=vision", "edgeserve_bundle_version=2", "edgeserve_model=mlp:1"} <= inventory

    # v3, as an artifact made with mender-artifact alone (the payload is the .esb itself), rolled back
    v3 = raw_artifact(fleet.bundle(3), "vision-v3")
    _ok(env.mender("install", str(v3)))
    assert _active(fleet) == 3
    _ok(env.mender("rollback"))
    assert _active(fleet) == 2 and env.artifact_name() == "vision-v2"
    assert status(fleet.state)["previous_version"] == 3  # kept, verified

    # the same artifact again: v3 was installed once (a replay for the installer), so the module switches
    # back to the kept, verified copy instead of refusing it
    _ok(env.mender("install", str(v3)))
    _ok(env.mender("commit"))
    assert _active(fleet) == 3 and env.artifact_name() == "vision-v3"
    assert env.mender("commit").returncode != 0  # nothing left to commit


def test_a_failed_trial_and_a_bundle_that_stopped_serving_roll_back(env: MenderEnv, fleet: Fleet) -> None:
    factory = env.artifact_name()
    repo = fleet.repo(2, {"mlp": {"builder": "mlp", "seed": 2}})
    bad = wrap(fleet.bundle(2, checks=[mlp_check(repo, wrong=True)]))
    failed = env.mender("install", str(bad))
    assert failed.returncode != 0
    assert "trial failed" in failed.stderr, failed.stderr
    assert _active(fleet) == 1 and env.artifact_name() == factory
    assert env.mender("commit").returncode != 0  # nothing was left pending

    # installed and serving, then the appliance went back to v1 (a crash-loop rollback, an operator):
    # the commit fails and Mender rolls the deployment back
    _ok(env.mender("install", str(wrap(fleet.bundle(2)))))
    assert _active(fleet) == 2
    edgeserve("bundle", "rollback", "--to", "1", "--state-dir", str(fleet.state), check=True)
    commit = env.mender("commit")
    assert commit.returncode != 0 and "no longer serves" in commit.stderr, commit.stderr
    assert _active(fleet) == 1 and env.artifact_name() == factory


def test_an_artifact_for_another_device_type_or_version_is_refused(env: MenderEnv, fleet: Fleet) -> None:
    factory = env.artifact_name()
    refused = env.mender("install", str(wrap(fleet.bundle(2), "other-device")))
    assert refused.returncode != 0
    assert "other-device" in refused.stderr and "edge-x86" in refused.stderr, refused.stderr
    # made to go on top of vision v5 only (a Mender depends): this device does not provide it
    after_v5 = env.mender("install", str(wrap(fleet.bundle(6), "edge-x86", "--depends-version", "5")))
    assert after_v5.returncode != 0 and "edgeserve-bundle.vision.version" in after_v5.stderr, after_v5.stderr
    assert _active(fleet) == 1 and env.artifact_name() == factory
    assert not (fleet.state / "mender").exists()  # the module never ran
    assert [h.get("version") for h in status(fleet.state)["history"]] == [1]


def test_client_killed_mid_install_then_recovered(env: MenderEnv, fleet: Fleet) -> None:
    v2 = wrap(fleet.bundle(2))
    held = fleet.state / "ota" / "held"
    client = env.start("install", str(v2), env={"EDGESERVE_TEST_OTA_HOLD": "STAGED"})
    wait_file(held, 60, client)
    kill_tree(client.pid)  # mender, the module and the installer it ran: a power cut of the client side
    held.unlink()
    assert status(fleet.state)["state"] == "STAGED"  # the journal says an install was under way
    assert env.mender("commit").returncode != 0  # Mender never recorded it
    # Deploying again: the interrupted install is undone first, then this one runs to the end
    _ok(env.mender("install", str(v2)))
    _ok(env.mender("commit"))
    assert _active(fleet) == 2 and env.artifact_name() == "vision-v2"
    history = status(fleet.state)["history"]
    assert "interrupted" in history[-2]["reason"] and history[-1]["state"] == "COMMITTED"


def test_appliance_killed_mid_install_then_recovered(env: MenderEnv, fleet: Fleet, tmp_path: Path) -> None:
    from appliance import start_appliance

    factory = env.artifact_name()
    (tmp_path / "empty").mkdir()
    config = "[ota]\ntrial_window_s = 1.0\n[supervisor]\nrestart_initial_s = 0.2\n"
    args = ["--state-dir", str(fleet.state)]
    hold = {"EDGESERVE_SERVER_STATE_DIR": "", "EDGESERVE_TEST_OTA_HOLD": "LOADING"}
    app = start_appliance(tmp_path / "empty", tmp_path, args=args, config=config, env=hold)
    app.notify.wait_for("READY", timeout=90)
    v2 = wrap(fleet.bundle(2))
    client = env.start("install", str(v2))
    wait_file(fleet.state / "ota" / "held", 60, client)
    kill_tree(app.process.pid)  # supervisor, server and all: the appliance loses power mid-install
    (fleet.state / "ota" / "held").unlink()
    output, _ = client.communicate(timeout=120)
    assert client.returncode != 0, output
    assert "closed the connection" in output, output
    assert _active(fleet) == 1 and env.artifact_name() == factory  # undone (ArtifactRollback), v1 serves

    (tmp_path / "again").mkdir()
    again = start_appliance(tmp_path / "empty", tmp_path / "again", args=args, config=config,
                            env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    try:
        again.notify.wait_for("READY", timeout=90)
        installed = env.mender("install", str(v2))
        _ok(installed)
        assert "LOADING" in installed.stderr  # progress came from the appliance's installer
        _ok(env.mender("commit"))
        assert _active(fleet) == 2 and env.artifact_name() == "vision-v2"
        assert again.get("/v2/models/mlp/ready") == 200
        inventory = _inventory(env)  # the backend the appliance chose, from its runtime plan
        assert "edgeserve_bundle_version=2" in inventory and "edgeserve_backend=mlp:onnxruntime" in inventory
    finally:
        again.stop()
