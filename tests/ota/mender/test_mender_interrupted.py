"""`kill -9` in every state of the edgeserve-bundle Update Module, through the real Mender client (standalone
mode), then `mender rollback` or the next `mender install`: the device ends on a bundle, and what Mender
records (`mender show-artifact`, the provides) names the bundle that serves.

A kill lands at a known point: the module (or the installer it runs) waits at the point named by
EDGESERVE_TEST_MENDER_HOLD / EDGESERVE_TEST_OTA_HOLD and says so in a `held` file, and the test kills
then. Two kills:
  client  only the `mender` process (an operator's kill -9, the OOM killer): the module, which Mender
          starts in its own process group, lives on and finishes its state
  power   `mender` with the module and the installer it runs (a power cut of the client side)
`<State>` is a kill as the state begins (or between the state before and it), `<State>:done` once its work
is done (between it and the next). Every killed deployment is of v2 onto a device serving v1, which
Mender names `edgeserve-initial`; no kill lets Mender record v2, so each case ends on v1 and that name
(after the next install's rollback, for the one case `mender rollback` cannot settle: UNRECORDED).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "supervisor"))
from mender_env import MenderEnv, fleet_fixture, kill_tree, unavailable, wait_file, wrap
from ota_fixtures import Fleet, mlp_check

from edgeserve.ota.installer import recover
from edgeserve.ota.store import Store

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

fleet = fleet_fixture()  # serving vision v1: a copy per test of one install (it costs a trial server)

FACTORY = "edgeserve-initial"  # what Mender names the device's artifact before any deployment
# (command, point, kill): `install` deploys v2; `commit` / `rollback` end an install of v2 that went
# through (Mender holds it open); `failed` deploys a v2 whose trial fails (Mender then runs
# ArtifactRollback, ArtifactFailure and Cleanup). The installer's points (STAGED, SWITCHED) are power
# cuts only: its hold cannot be let go. A `client` kill is tried where a surviving module has work left.
POWER = ["Download", "ArtifactInstall", "STAGED", "SWITCHED", "ArtifactInstall:done", "NeedsArtifactReboot"]
CLIENT = ["Download", "ArtifactInstall", "ArtifactInstall:done", "NeedsArtifactReboot"]
OPEN = [
    ("commit", "ArtifactCommit"),
    ("commit", "ArtifactCommit:done"),
    ("commit", "Cleanup:done"),
    ("rollback", "ArtifactRollback"),
    ("rollback", "ArtifactRollback:done"),
    ("rollback", "Cleanup:done"),
]
CASES = (
    [("install", point, "power") for point in POWER]
    + [("install", point, "client") for point in CLIENT]
    + [(*step, "power") for step in OPEN]
    + [("commit", "ArtifactCommit", "client"), ("rollback", "ArtifactRollback", "client")]
    + [("failed", point, kill) for point in ("ArtifactFailure", "ArtifactFailure:done")
       for kill in ("power", "client")]
)  # fmt: skip
# A power cut after the switch but before Mender recorded the install (it does once ArtifactInstall and
# NeedsArtifactReboot returned) leaves Mender nothing to roll back: v2 serves under the old name until the
# next `mender install`, which undoes it first. (A `mender` killed alone is covered: the module undoes.)
UNRECORDED = {("install", "ArtifactInstall:done", "power"), ("install", "NeedsArtifactReboot", "power")}


def _id(case: tuple[str, str, str]) -> str:
    return "-".join(case).replace(":", "_")


@pytest.fixture
def env(fleet: Fleet, tmp_path: Path) -> MenderEnv:
    return MenderEnv(tmp_path / "mender", fleet.state)


def _serving(state: Path) -> int | None:
    """The version the appliance serves from its next start (which first undoes a half-done install)."""
    store = Store(state)
    with store.lock():
        recover(store)
    active = store.active()
    return active.version if active is not None else None


def _module(env: MenderEnv, query: str) -> str:
    script = env.modules / "edgeserve-bundle"
    return subprocess.run([str(script), query], capture_output=True, text=True, env=env.env(),
                          check=True, timeout=60).stdout.strip()  # fmt: skip


def _assert_agrees(env: MenderEnv, fleet: Fleet, version: int, name: str) -> None:
    """`version` serves, Mender names `name`, and its provides and the module's answers agree."""
    assert _serving(fleet.state) == version
    assert env.artifact_name() == name
    provides = env.provides()
    if name == FACTORY:
        assert "edgeserve-bundle.vision.version" not in provides, provides
    else:
        assert provides["edgeserve-bundle.vision.version"] == str(version), provides
    assert _module(env, "SupportsRollback") == "Yes" and _module(env, "NeedsArtifactReboot") == "No"


def _no_abnormal_end(result: subprocess.CompletedProcess[str]) -> None:
    assert "terminated abnormally" not in result.stderr, result.stderr
    assert result.returncode == 0 or "There is nothing to commit" in result.stderr, result.stderr


def _kill(env: MenderEnv, fleet: Fleet, args: list[str], point: str, kill: str) -> None:
    """Run `mender <args>`, kill it (`kill`) where `point` holds, and let a surviving module finish."""
    inside = point.isupper()  # the installer's hold points are its journal states
    marker = fleet.state / ("ota" if inside else "mender") / "held"
    hold = {"EDGESERVE_TEST_OTA_HOLD" if inside else "EDGESERVE_TEST_MENDER_HOLD": point}
    client = env.start(*args, env=hold)
    wait_file(marker, 120, client)
    if kill == "power":
        kill_tree(client.pid)
    else:
        module = psutil.Process(int(marker.read_text().split()[1]))
        client.kill()
        client.wait(30)
    marker.unlink()  # the module (or installer) goes on from its hold: killed, or on its own
    if kill == "client":
        module.wait(180)  # generous: it may still run a trial or a rollback; it never hangs


def _deploy(env: MenderEnv, fleet: Fleet, command: str, point: str, kill: str) -> None:
    """v2 deployed onto v1 and killed at `point` of `command`."""
    if command == "failed":
        repo = fleet.repo(2, {"mlp": {"builder": "mlp", "seed": 2}})
        bad = wrap(fleet.bundle(2, checks=[mlp_check(repo, wrong=True)]))
        _kill(env, fleet, ["install", str(bad)], point, kill)
        return
    v2 = wrap(fleet.bundle(2))
    if command == "install":
        _kill(env, fleet, ["install", str(v2)], point, kill)
        return
    installed = env.mender("install", str(v2))
    assert installed.returncode == 0, installed.stderr
    _kill(env, fleet, [command], point, kill)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_killed_then_mender_rollback(env: MenderEnv, fleet: Fleet, case: tuple[str, str, str]) -> None:
    command = case[0]
    _deploy(env, fleet, *case)
    rollback = env.mender("rollback")
    _no_abnormal_end(rollback)
    if case in UNRECORDED:
        assert "There is nothing to commit" in rollback.stderr
        assert _serving(fleet.state) == 2 and env.artifact_name() == FACTORY  # until the next install
    else:
        _assert_agrees(env, fleet, 1, FACTORY)
    assert env.mender("rollback").returncode != 0  # nothing left open: Mender has nothing to roll back
    if case[2] == "client":  # the module finished its state: no copy of the bundle is left behind
        assert not (fleet.state / "mender" / "incoming").exists()
    if command in ("install", "failed"):
        # Mender never held this deployment, so `mender rollback` left all as the kill did: the next
        # install finds it so
        _next_install_settles(env, fleet)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("commit", "rollback")], ids=_id)
def test_killed_then_the_next_install(env: MenderEnv, fleet: Fleet, case: tuple[str, str, str]) -> None:
    """Mender still holds v2's deployment open (uncommitted) and names v1 when v3 comes."""
    _deploy(env, fleet, *case)
    _next_install_settles(env, fleet)


def _next_install_settles(env: MenderEnv, fleet: Fleet) -> None:
    """`mender install v3` goes through, and its rollback ends where Mender's record says (v1): the
    interrupted deployment was undone first, so v1 was still kept to go back to."""
    installed = env.mender("install", str(wrap(fleet.bundle(3))))
    _no_abnormal_end(installed)
    assert installed.returncode == 0 and _serving(fleet.state) == 3, installed.stderr
    rollback = env.mender("rollback")
    _no_abnormal_end(rollback)
    assert rollback.returncode == 0
    _assert_agrees(env, fleet, 1, FACTORY)


def test_an_install_over_an_uncommitted_one_then_rollback(env: MenderEnv, fleet: Fleet) -> None:
    """Issue 33's case: v2 installed and never committed, v3 installed over it, then `mender rollback`.
    Mender still names what served before v2; v2 is undone before v3 installs, so that is still kept."""
    first = env.mender("install", str(wrap(fleet.bundle(2))))
    assert first.returncode == 0, first.stderr
    second = env.mender("install", str(wrap(fleet.bundle(3))))
    _no_abnormal_end(second)
    assert second.returncode == 0 and _serving(fleet.state) == 3
    rollback = env.mender("rollback")
    _no_abnormal_end(rollback)
    assert rollback.returncode == 0
    _assert_agrees(env, fleet, 1, FACTORY)
    # the same, committed: v5 over an uncommitted v4 names and serves v5, and v1 stays the rollback target
    assert env.mender("install", str(wrap(fleet.bundle(4)))).returncode == 0
    assert env.mender("install", str(wrap(fleet.bundle(5)))).returncode == 0
    commit = env.mender("commit")
    assert commit.returncode == 0, commit.stderr
    _assert_agrees(env, fleet, 5, "vision-v5")
    previous = Store(fleet.state).previous()
    assert previous is not None and previous.version == 1


def test_client_killed_while_the_appliance_installs(env: MenderEnv, fleet: Fleet, tmp_path: Path) -> None:
    """With the appliance running, the install runs in it and goes on after `mender` died; the module,
    still waiting on it, then finds its `mender` gone and undoes it through the appliance."""
    from appliance import start_appliance

    (tmp_path / "empty").mkdir()
    app = start_appliance(tmp_path / "empty", tmp_path, args=["--state-dir", str(fleet.state)],
                          config="[ota]\ntrial_window_s = 1.0\n",
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    try:
        app.notify.wait_for("READY", timeout=90)
        _kill(env, fleet, ["install", str(wrap(fleet.bundle(2)))], "ArtifactInstall", "client")
        rollback = env.mender("rollback")
        _no_abnormal_end(rollback)
        _assert_agrees(env, fleet, 1, FACTORY)
        history = Store(fleet.state).journal()["history"]
        assert [h["state"] for h in history[-2:]] == ["COMMITTED", "ROLLED_BACK"], history[-2:]
        assert app.get("/v2/models/mlp/ready") == 200
    finally:
        app.stop()
