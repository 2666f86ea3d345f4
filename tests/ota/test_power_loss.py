"""kill -9 at every step of an install: the next start finds a consistent store, serves exactly the old
bundle (never a mix), has undone the install and says so in the history.

The installer stops at a named point when EDGESERVE_TEST_OTA_HOLD names it (a test hook, after the journal
write for that step); the harness then SIGKILLs the installing process group and starts the appliance."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from ota_fixtures import FAST, ROOT, Fleet, X, edgeserve, make_fleet, mlp_output, status, wait_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
from appliance import Appliance, start_appliance

V2_MODELS = {"mlp": {"builder": "mlp", "seed": 2}, "conv": {"builder": "conv"}}
# Two 2 MB files after the model: half-way through the bytes, one is written and one is not.
V2_EXTRA = {"mlp/1/a.bin": os.urandom(2 * 2**20), "mlp/1/b.bin": os.urandom(2 * 2**20)}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Fleet, Path]:
    """A device state folder with v1 installed, and the v2 bundle; each test copies the state."""
    fleet = make_fleet(tmp_path_factory.mktemp("fleet"))
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    return fleet, fleet.bundle(2, V2_MODELS, extra=V2_EXTRA)


def _serve_and_check(fleet: Fleet, state: Path, tmp: Path) -> Appliance:
    (tmp / "empty").mkdir(exist_ok=True)
    app = start_appliance(
        tmp / "empty", tmp, args=["--state-dir", str(state)], env={"EDGESERVE_SERVER_STATE_DIR": ""}
    )
    app.notify.wait_for("READY", timeout=60)
    import json
    import urllib.request

    request = urllib.request.Request(app.base + "/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        served = {e["name"] for e in json.loads(response.read())}
    assert served == {"mlp"}, served  # exactly v1's models: no conv from v2
    client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http_port}")
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    got = client.infer("mlp", [inp]).as_numpy("OUTPUT0").ravel()
    client.close()
    assert np.allclose(got, mlp_output(fleet.tmp / "repo-v1-mlp" / "mlp" / "1" / "model.onnx"), atol=1e-5)
    return app


def wait_gone(pid: int) -> None:
    import time

    import psutil

    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"server {pid} outlived its supervisor"
        time.sleep(0.05)


def _assert_recovered(state: Path, point: str) -> None:
    info = status(state)
    assert info["state"] == "IDLE" and info["active_version"] == 1, info
    last = info["history"][-1]  # type: ignore[index]
    assert last["state"] in ("FAILED", "ROLLED_BACK") and "interrupted in" in last["reason"], last
    assert info["kept_versions"] == [1], info  # the half-installed v2 is gone
    assert list((state / "ota" / "staging").iterdir()) == []


@pytest.mark.parametrize(
    "point", ["DOWNLOADING", "EXTRACTING", "STAGED", "LOADING", "TRIAL", "SWITCHED", "ACTIVATED"]
)
def test_offline_install_killed_at(point: str, prepared: tuple[Fleet, Path], tmp_path: Path) -> None:
    fleet, bundle = prepared
    state = tmp_path / "state"
    shutil.copytree(fleet.state, state, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
    (state / "ota" / "held").unlink(missing_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeserve", "bundle", "install", str(bundle), "--state-dir", str(state)],
        cwd=ROOT,
        env={**os.environ, **FAST, "EDGESERVE_TEST_OTA_HOLD": point},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_file(state / "ota" / "held", 60)
        assert (state / "ota" / "held").read_text() == point
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the CLI and its trial server: a pulled plug
        process.wait(10)
    (state / "ota" / "held").unlink()
    app = _serve_and_check(fleet, state, tmp_path)
    try:
        _assert_recovered(state, point)
        assert "interrupted in" in app.log()
    finally:
        app.stop()


def test_appliance_killed_in_the_middle_of_a_live_switch(
    prepared: tuple[Fleet, Path], tmp_path: Path
) -> None:
    fleet, bundle = prepared
    state = tmp_path / "state"
    shutil.copytree(fleet.state, state, symlinks=True, ignore=shutil.ignore_patterns("*.sock"))
    (tmp_path / "empty").mkdir()
    app = start_appliance(
        tmp_path / "empty",
        tmp_path,
        args=["--state-dir", str(state)],
        env={"EDGESERVE_SERVER_STATE_DIR": "", "EDGESERVE_TEST_OTA_HOLD": "SWITCHED", **FAST},
    )
    app.notify.wait_for("READY", timeout=60)
    server = app.server_pid()
    client = subprocess.Popen(
        [sys.executable, "-m", "edgeserve", "bundle", "install", str(bundle), "--state-dir", str(state)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_file(state / "ota" / "held", 60)
        assert os.readlink(state / "ota" / "current").endswith("vision-v2")  # the link had moved
        app.process.kill()  # the supervisor, mid-install; the server follows it (PDEATHSIG)
        app.process.wait(10)
    finally:
        client.wait(30)
    assert client.returncode != 0  # the CLI says the install did not finish
    wait_gone(server)
    (state / "ota" / "held").unlink()
    app.notify.close()
    (tmp_path / "again").mkdir()
    again = _serve_and_check(fleet, state, tmp_path / "again")
    try:
        _assert_recovered(state, "TRIAL")
    finally:
        again.stop()
