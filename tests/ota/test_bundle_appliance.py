"""`edgeserve bundle ...` as a user runs it, against a running appliance (`edgeserve run --state-dir`):
install with progress while clients load the server (zero errors), from a URL through a faulty
network, rollback, the crash-loop rollback, and a model name in two places refused at start."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from bundle_server import BundleServer
from ota_fixtures import Fleet, X, edgeserve, make_fleet, mlp_check, mlp_output, status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
from appliance import Appliance, start_appliance, wait_until


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


@pytest.fixture
def appliance(fleet: Fleet, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The appliance on fleet.state, v1 of the bundle installed offline first, no other models."""
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    (tmp_path / "empty").mkdir()
    app = start_appliance(
        tmp_path / "empty",
        tmp_path,
        args=["--state-dir", str(fleet.state)],
        config="[ota]\ntrial_window_s = 1.0\n",
        env={"EDGESERVE_SERVER_STATE_DIR": ""},
    )
    app.notify.wait_for("READY", timeout=60)
    yield app
    app.stop()


def _infer(app: Appliance, model: str = "mlp") -> list[float]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http_port}")
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    try:
        return [float(v) for v in client.infer(model, [inp]).as_numpy("OUTPUT0").ravel()]
    finally:
        client.close()


def _models(app: Appliance) -> dict[str, str]:
    import urllib.request

    request = urllib.request.Request(app.base + "/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        return {e["name"]: e["state"] for e in json.loads(response.read())}


def test_offline_install_then_run_serves_the_bundle(appliance: Appliance, fleet: Fleet) -> None:
    expected = mlp_output(fleet.tmp / "repo-v1-mlp" / "mlp" / "1" / "model.onnx")
    assert np.allclose(_infer(appliance), expected, atol=1e-5)
    assert _models(appliance) == {"mlp": "READY"}
    assert status(fleet.state)["active_version"] == 1


def test_live_install_under_load_loses_no_request(appliance: Appliance, fleet: Fleet) -> None:
    repo = fleet.repo(2, {"mlp": {"builder": "mlp", "seed": 2}, "conv": {"builder": "conv"}})
    bundle = fleet.bundle(
        2, {"mlp": {"builder": "mlp", "seed": 2}, "conv": {"builder": "conv"}}, checks=[mlp_check(repo)]
    )
    counts = {"http": 0, "grpc": 0}
    errors: list[str] = []
    stop = threading.Event()

    def load(via: str, module: Any, url: str) -> None:
        client = module.InferenceServerClient(url)
        inp = module.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(X)
        while not stop.is_set():
            try:
                client.infer("mlp", [inp])
                counts[via] += 1
            except Exception as exc:
                errors.append(f"{via}: {exc}")
        client.close()

    threads = [
        threading.Thread(target=load, args=("http", httpclient, f"127.0.0.1:{appliance.http_port}")),
        threading.Thread(target=load, args=("grpc", grpcclient, appliance.grpc_url)),
    ]
    for thread in threads:
        thread.start()
    try:
        result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(fleet.state))
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert result.returncode == 0, result.stderr
    assert "COMMITTED: vision v2 serves" in result.stdout  # the end, once, on stdout
    for state in ("VERIFYING", "STAGED", "LOADING", "TRIAL"):
        assert state in result.stderr, result.stderr  # the progress the user saw
    assert errors == [] and counts["http"] > 20 and counts["grpc"] > 20, (counts, errors[:3])
    assert np.allclose(_infer(appliance), mlp_output(repo / "mlp" / "1" / "model.onnx"), atol=1e-5)
    assert _models(appliance) == {"conv": "READY", "mlp": "READY"}
    info = status(fleet.state)
    assert info["active_version"] == 2 and info["previous_version"] == 1 and info["state"] == "IDLE"
    assert "[trial]" in appliance.log()  # the trial server ran beside the serving one


def test_install_from_a_url_over_a_dropping_link(
    appliance: Appliance, fleet: Fleet, bundle_server: BundleServer
) -> None:
    data = fleet.bundle(2).read_bytes()
    url = bundle_server.add("/bundles/v2.esb", data, drop_after=len(data) // 3, times=2)
    result = edgeserve("bundle", "install", url, "--state-dir", str(fleet.state))
    assert result.returncode == 0, result.stderr
    ranges = [r.range for r in bundle_server.requests("/bundles/v2.esb") if r.range]
    assert ranges, "the download resumed with Range requests"
    assert status(fleet.state)["active_version"] == 2


def test_refusal_is_one_line_and_changes_nothing(appliance: Appliance, fleet: Fleet) -> None:
    other = make_fleet(fleet.tmp / "attacker")
    bundle = other.bundle(9)  # signed by a key the device does not trust
    result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(fleet.state))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("edgeserve: refused: signature: signed by unknown key"), last
    assert result.stderr.count("signed by unknown key") == 1, result.stderr  # one final reason
    assert status(fleet.state)["active_version"] == 1 and _models(appliance) == {"mlp": "READY"}


def test_rollback_through_the_appliance(appliance: Appliance, fleet: Fleet) -> None:
    edgeserve("bundle", "install", str(fleet.bundle(2)), "--state-dir", str(fleet.state), check=True)
    result = edgeserve("bundle", "rollback", "--to", "1", "--state-dir", str(fleet.state))
    assert result.returncode == 0 and "ROLLED_BACK" in result.stdout, result.stderr
    expected = mlp_output(fleet.tmp / "repo-v1-mlp" / "mlp" / "1" / "model.onnx")
    assert np.allclose(_infer(appliance), expected, atol=1e-5)
    bad = edgeserve("bundle", "rollback", "--to", "7", "--state-dir", str(fleet.state))
    assert bad.returncode != 0 and "version 7 is not kept" in bad.stderr


def test_crash_loop_after_a_switch_rolls_back(appliance: Appliance, fleet: Fleet) -> None:
    edgeserve("bundle", "install", str(fleet.bundle(2)), "--state-dir", str(fleet.state), check=True)
    appliance.config_path.write_text("[supervisor]\nrestart_initial_s = 0.1\n[ota]\ntrial_window_s = 1.0\n")
    appliance.signal(signal.SIGHUP)
    pid = appliance.server_pid()
    for _ in range(3):  # a bundle that keeps killing the server
        appliance.wait_ready(60)
        os.kill(pid, signal.SIGKILL)
        pid = appliance.server_pid(not_pid=pid)
    wait_until(lambda: status(fleet.state)["active_version"] == 1, 30, "the rollback to v1")
    appliance.wait_ready(60)
    expected = mlp_output(fleet.tmp / "repo-v1-mlp" / "mlp" / "1" / "model.onnx")
    assert np.allclose(_infer(appliance), expected, atol=1e-5)
    assert "rolled back to vision v1" in appliance.log()


def test_a_model_in_both_places_is_an_error_at_start(fleet: Fleet, tmp_path: Path) -> None:
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    result = edgeserve(
        "serve",
        "--state-dir",
        str(fleet.state),
        "--model-repository",
        str(fleet.tmp / "repo-v1-mlp"),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--no-zmq",
    )
    assert result.returncode == 1
    assert "model 'mlp' is both in the model repository" in result.stderr


def test_when_two_copies_do_not_fit_it_reloads_in_place_and_reports_the_downtime(
    appliance: Appliance, fleet: Fleet
) -> None:
    appliance.config_path.write_text("[ota]\ntrial_window_s = 1.0\ntrial_memory_mb = 1\n")
    appliance.signal(signal.SIGHUP)
    wait_until(lambda: "reload: applying live: ota.trial_memory_mb" in appliance.log(), 10, "the reload")
    repo = fleet.repo(2, {"mlp": {"builder": "mlp", "seed": 2}})
    result = edgeserve(
        "bundle", "install", str(fleet.bundle(2, checks=[mlp_check(repo)])), "--state-dir", str(fleet.state)
    )
    assert result.returncode == 0, result.stderr
    assert "two copies do not fit" in result.stderr and "unavailable for" in result.stderr
    assert "[trial]" not in appliance.log()  # no second server was started
    assert np.allclose(_infer(appliance), mlp_output(repo / "mlp" / "1" / "model.onnx"), atol=1e-5)
