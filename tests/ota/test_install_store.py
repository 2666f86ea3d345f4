"""The installer on a real store with a real trial server (no appliance running): commit, refusals that
leave everything as it was, trial failures, rollback to a kept version, garbage collection."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bundle_server import BundleServer
from ota_fixtures import FAST, ROOT, Fleet, edgeserve, make_fleet, mlp_check

from edgeserve.ota.errors import StoreError
from edgeserve.ota.installer import Installer
from edgeserve.ota.store import Store
from edgeserve.supervisor.activate import OfflineActivator, TrialRunner


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


def _installer(fleet: Fleet) -> Installer:
    return Installer(Store(fleet.state), OfflineActivator(TrialRunner(fleet.state, None, window_s=0.5)))


def _events() -> tuple[list[tuple[str, float | None, str]], object]:
    seen: list[tuple[str, float | None, str]] = []
    return seen, lambda state, progress, message: seen.append((state, progress, message))


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


def test_install_commits_and_status_tells_the_story(fleet: Fleet) -> None:
    repo_checks = [mlp_check(fleet.repo(1, {"mlp": {"builder": "mlp", "seed": 1}}))]
    bundle = fleet.bundle(1, checks=repo_checks)
    seen, report = _events()
    outcome = _installer(fleet).install(str(bundle), report)  # type: ignore[arg-type]
    assert outcome.ok and outcome.state == "COMMITTED" and outcome.version == 1, outcome
    states = [state for state, _, _ in seen]
    for state in ("DOWNLOADING", "VERIFYING", "STAGED", "LOADING", "TRIAL", "COMMITTED"):
        assert state in states, states
    assert (
        states.index("STAGED") < states.index("LOADING") < states.index("TRIAL") < states.index("COMMITTED")
    )
    store = Store(fleet.state)
    active = store.active()
    assert active is not None and active.version == 1
    assert (active.path / "models" / "mlp" / "1" / "model.onnx").is_file()
    status = store.status()
    assert status["active_version"] == 1 and status["previous_version"] is None and status["state"] == "IDLE"
    assert status["history"][-1]["state"] == "COMMITTED"
    assert [t[0] for t in status["history"][-1]["transitions"]] == [
        "DOWNLOADING",
        "VERIFYING",
        "VERIFYING",
        "STAGED",
        "LOADING",
        "TRIAL",
        "COMMITTED",
    ]
    assert _tree(store.staging) == set()


def test_a_failed_check_keeps_the_old_bundle_and_removes_the_new(fleet: Fleet) -> None:
    assert _installer(fleet).install(str(fleet.bundle(1)), lambda *a: None).ok
    repo = fleet.repo(2, {"mlp": {"builder": "mlp", "seed": 2}})
    bundle = fleet.bundle(2, checks=[mlp_check(repo, wrong=True)])
    outcome = _installer(fleet).install(str(bundle), lambda *a: None)
    assert not outcome.ok and outcome.state == "FAILED"
    assert "trial failed" in outcome.reason and "OUTPUT0" in outcome.reason
    store = Store(fleet.state)
    assert store.active() is not None and store.active().version == 1  # type: ignore[union-attr]
    assert [v.version for v in store.kept()] == [1]
    assert store.journal()["installed"] == {"vision": 1}  # v2 may come again, fixed


def test_a_model_that_does_not_load_fails_the_trial(fleet: Fleet) -> None:
    bundle = fleet.bundle(1, extra={"mlp/1/model.onnx": b"this is not an onnx model"})
    outcome = _installer(fleet).install(str(bundle), lambda *a: None)
    assert outcome.state == "FAILED" and "did not load" in outcome.reason, outcome
    assert Store(fleet.state).active() is None


def test_a_refused_bundle_writes_nothing_but_the_history(fleet: Fleet) -> None:
    installer = _installer(fleet)
    assert installer.install(str(fleet.bundle(3)), lambda *a: None).ok
    before = _tree(fleet.state) - {"ota/journal.json"}
    for bundle, reason in ((fleet.bundle(2), "downgrade"), (fleet.bundle(3), "replay")):
        outcome = installer.install(str(bundle), lambda *a: None)
        assert outcome.state == "FAILED" and f"refused: {reason}" in outcome.reason, outcome
    assert _tree(fleet.state) - {"ota/journal.json"} == before
    history = Store(fleet.state).journal()["history"]
    assert [h["state"] for h in history] == ["COMMITTED", "FAILED", "FAILED"]


def test_rollback_only_to_a_kept_version_and_gc_keeps_two(fleet: Fleet) -> None:
    installer = _installer(fleet)
    for version in (1, 2, 3):
        assert installer.install(str(fleet.bundle(version)), lambda *a: None).ok
    store = Store(fleet.state)
    assert [v.version for v in store.kept()] == [2, 3]  # v1 collected
    with pytest.raises(StoreError, match="version 1 is not kept"):
        installer.rollback(1, lambda *a: None)
    outcome = installer.rollback(2, lambda *a: None)
    assert outcome.ok and outcome.state == "ROLLED_BACK"
    assert store.active().version == 2 and store.previous().version == 3  # type: ignore[union-attr]
    assert store.status()["history"][-1]["state"] == "ROLLED_BACK"


def test_one_install_at_a_time_per_store(fleet: Fleet) -> None:
    store = Store(fleet.state)
    with store.lock(), pytest.raises(StoreError, match="another install"):
        _installer(fleet).install(str(fleet.bundle(1)), lambda *a: None)


def test_cli_prints_a_refusal_once(fleet: Fleet) -> None:
    """One line per phase, then the reason once (not again as a FAILED phase, nor as a log warning)."""
    bundle = make_fleet(fleet.tmp / "stranger").bundle(1)
    result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(fleet.state))
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    phases = [line.split()[0] for line in lines[:-1]]
    assert [phase for phase, _ in itertools.groupby(phases)] == ["DOWNLOADING", "VERIFYING"], lines
    assert lines[-1].startswith("edgeserve: refused: signature: signed by unknown key"), lines
    assert result.stderr.count("signed by unknown key") == 1, result.stderr


def _part_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.glob("*.part"))
    except FileNotFoundError:  # not created yet, or renamed while we looked
        return 0


def test_a_download_cut_by_a_kill_resumes_at_the_next_install(
    fleet: Fleet, bundle_server: BundleServer
) -> None:
    """The one download a restart may leave behind is the one the next install of that URL resumes."""
    data = fleet.bundle(1, extra={"mlp/1/pad.bin": os.urandom(3 * 2**20)}).read_bytes()
    url = bundle_server.add("/v1.esb", data, stall_after=2**20, stall_s=30, times=1)
    downloads = fleet.state / "ota" / "downloads"
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeserve", "bundle", "install", url, "--state-dir", str(fleet.state)],
        cwd=ROOT, env={**os.environ, **FAST}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while _part_bytes(downloads) < 2**20:
            assert time.monotonic() < deadline, "the download never got going"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # a pulled plug, mid-download
        process.wait(10)
    result = edgeserve("bundle", "install", url, "--state-dir", str(fleet.state))
    assert result.returncode == 0 and "COMMITTED: vision v1 serves" in result.stdout, result.stderr
    ranges = [r.range for r in bundle_server.requests("/v1.esb")]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes="), ranges
    assert int(ranges[1].removeprefix("bytes=").rstrip("-")) >= 2**20  # resumed, not started over
    assert list(downloads.iterdir()) == []
