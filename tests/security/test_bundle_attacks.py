"""Bundle attacks (issue 22, "Bundles"), tried as an attacker would, each checking the refusal and that
nothing was left behind:

- folders the signed file list does not imply (an extra folder, an empty one, one named like a model
  version) are refused by `bundle verify` and by install, and nothing is created;
- an older `security_version` under another bundle name is refused once a newer one committed, across
  restarts; an explicit `rollback --to` a kept version stays allowed; the floor rises only with a commit;
- refused URL installs leave nothing in `ota/downloads` (three times in a row); `gc` removes stale
  downloads and never the one in progress; a download that cannot fit is refused before it fills the
  disk (a real tmpfs; and through the statvfs seam where no tmpfs can be mounted).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from bundle_helpers import crafted, downloads, install, installer, small_tmpfs, tree, wait_until
from bundle_server import BundleServer
from ota_fixtures import FAST, ROOT, Fleet, edgeserve, make_fleet, status, wait_file

from edgeserve.ota import policy as policy_module
from edgeserve.ota.errors import StoreError
from edgeserve.ota.installer import Outcome, recover
from edgeserve.ota.policy import Policy
from edgeserve.ota.store import Store

MB = 2**20


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


@pytest.fixture
def bundle_server() -> Iterator[BundleServer]:
    with BundleServer() as server:
        yield server


def _state_tree(state: Path) -> dict[str, int]:
    return {k: v for k, v in tree(state).items() if k not in ("ota/journal.json", "ota/install.lock")}


# ------------------------------------------------------------------------- folders not in the manifest
@pytest.mark.parametrize(
    "folder",
    ["models/mlp/extra/", "models/mlp/1/empty/", "models/mlp/2/", "models/other/"],
    ids=["extra-folder", "empty-folder", "model-version-folder", "unlisted-model-folder"],
)
def test_folder_the_manifest_does_not_imply_is_refused(fleet: Fleet, tmp_path: Path, folder: str) -> None:
    bundle = crafted(fleet, tmp_path / "evil.esb", folders=(folder,))
    name = folder.rstrip("/")
    words = f"refused: extra: folder {name} is in the archive but holds no file of the signed manifest"

    verify = edgeserve("bundle", "verify", str(bundle), "--trust", str(fleet.state / "trust"))
    assert verify.returncode == 1 and "OK" not in verify.stdout, verify.stdout
    assert verify.stderr.strip().splitlines() == [f"edgeserve: {bundle}: {words}"], verify.stderr

    Store(fleet.state).ensure()
    before = _state_tree(fleet.state)
    result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(fleet.state))
    assert result.returncode == 1, result.stdout
    assert result.stderr.strip().splitlines()[-1] == f"edgeserve: {words}", result.stderr
    assert _state_tree(fleet.state) == before  # no bundle, no staging folder, no extra folder anywhere
    info = status(fleet.state)
    assert info["active"] is None and info["kept_versions"] == [] and info["installed"] == {}
    assert info["history"][-1]["state"] == "FAILED"  # type: ignore[index]


def test_the_same_bundle_without_the_extra_folder_verifies(fleet: Fleet, tmp_path: Path) -> None:
    """The control: the crafted bundles above differ from an accepted one by their folder only."""
    bundle = crafted(fleet, tmp_path / "good.esb")
    verify = edgeserve("bundle", "verify", str(bundle), "--trust", str(fleet.state / "trust"))
    assert verify.returncode == 0 and ": OK: vision v1" in verify.stdout, verify.stderr


# ---------------------------------------------------------------------------------- security_version
def _refused_below_floor(
    fleet: Fleet, bundle: Path, label: str, security_version: int, floor: int, *, recovering: bool = False
) -> None:
    before = _state_tree(fleet.state)
    result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(fleet.state))
    assert result.returncode == 1, result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"edgeserve: refused: security_version: {label} has security_version {security_version}, below this "
        f"device's floor of {floor} (roll back explicitly to a kept version instead)"
    ), result.stderr
    if not recovering:  # (a recovery removes what the interrupted install had staged)
        assert _state_tree(fleet.state) == before


def test_older_security_version_under_another_name_is_refused_across_restarts(fleet: Fleet) -> None:
    edgeserve("bundle", "install", str(fleet.bundle(1, security_version=3)), "--state-dir", str(fleet.state),
              check=True)  # fmt: skip
    assert status(fleet.state)["security_floor"] == 3
    # Another name, a higher version number, validly signed: only its security_version is old. Every
    # `edgeserve` call is a new process: the floor comes from the state folder each time.
    old = fleet.bundle(50, name="kiosk", security_version=2)
    _refused_below_floor(fleet, old, "kiosk v50", 2, 3)
    _refused_below_floor(fleet, fleet.bundle(2, name="vision", security_version=0), "vision v2", 0, 3)
    info = status(fleet.state)
    assert (
        info["active"] == "vision v1" and info["security_floor"] == 3 and info["installed"] == {"vision": 1}
    )

    # Even without its journal, a device never goes below what serves.
    journal = fleet.state / "ota" / "journal.json"
    saved = journal.read_bytes()
    journal.unlink()
    assert status(fleet.state)["security_floor"] == 3
    journal.write_bytes(saved)

    # The same security_version under another name is fine (the legit path: a new bundle name).
    same = fleet.bundle(1, name="kiosk", security_version=3)
    edgeserve("bundle", "install", str(same), "--state-dir", str(fleet.state), check=True)
    info = status(fleet.state)
    assert info["active"] == "kiosk v1" and info["security_floor"] == 3


def test_rollback_to_a_kept_version_below_the_floor_stays_allowed(fleet: Fleet) -> None:
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    edgeserve("bundle", "install", str(fleet.bundle(2, security_version=4)), "--state-dir", str(fleet.state),
              check=True)  # fmt: skip
    assert status(fleet.state)["security_floor"] == 4
    result = edgeserve("bundle", "rollback", "--to", "1", "--state-dir", str(fleet.state))
    assert result.returncode == 0 and "ROLLED_BACK: vision v1 serves" in result.stdout, result.stderr
    info = status(fleet.state)
    assert info["active"] == "vision v1" and info["security_floor"] == 4  # the rollback lowers nothing
    # The operator's explicit rollback is no door for the fleet's old bundles.
    _refused_below_floor(fleet, fleet.bundle(7, name="kiosk"), "kiosk v7", 0, 4)


def test_the_floor_rises_only_with_the_commit(fleet: Fleet) -> None:
    """Power cut after the switch, before the commit: the install is undone and the floor is where it was."""
    edgeserve("bundle", "install", str(fleet.bundle(1, security_version=3)), "--state-dir", str(fleet.state),
              check=True)  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeserve", "bundle", "install", str(fleet.bundle(2, security_version=9)),
         "--state-dir", str(fleet.state)],
        cwd=ROOT, env={**os.environ, **FAST, "EDGESERVE_TEST_OTA_HOLD": "ACTIVATED"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_file(fleet.state / "ota" / "held", 120)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    (fleet.state / "ota" / "held").unlink()
    # The next install recovers first (v1 serves again), then judges against the floor of 3, not 9.
    kiosk = fleet.bundle(3, name="kiosk", security_version=2)
    _refused_below_floor(fleet, kiosk, "kiosk v3", 2, 3, recovering=True)
    info = status(fleet.state)
    assert info["active"] == "vision v1" and info["security_floor"] == 3 and info["kept_versions"] == [1]
    assert "interrupted in TRIAL" in info["history"][-2]["reason"]  # type: ignore[index]


# -------------------------------------------------------------------------------- downloads left behind
@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Fleet, dict[str, Path]]:
    """A device with vision v5 (security_version 5) committed, and 3 MB bundles that it must refuse."""
    fleet = make_fleet(tmp_path_factory.mktemp("fleet"))
    edgeserve("bundle", "install", str(fleet.bundle(5, security_version=5)), "--state-dir", str(fleet.state),
              check=True)  # fmt: skip
    pad = {"mlp/1/pad.bin": os.urandom(3 * MB)}
    stranger = make_fleet(fleet.tmp / "stranger")
    bundles = {
        "signature": stranger.bundle(9, extra=pad),
        "downgrade": fleet.bundle(4, extra=pad, security_version=5),
        "replay": fleet.bundle(5, extra=pad, security_version=5),
        "security_version": fleet.bundle(1, name="kiosk", extra=pad),
        "incompatible": fleet.bundle(6, extra=pad, arch=["riscv64"], security_version=5),
        "extra": crafted(fleet, fleet.tmp / "extra.esb", version=6, folders=("models/mlp/2/",),
                         files={"models/mlp/1/pad.bin": pad["mlp/1/pad.bin"]}, security_version=5),
        "hash": fleet.bundle(7, extra=pad, security_version=5),  # installed with a wrong --sha256
        "oversized": fleet.bundle(8, extra=pad, security_version=5),  # under a 1 MiB cap
    }  # fmt: skip
    return fleet, bundles


@pytest.mark.parametrize(
    "kind",
    ["signature", "downgrade", "replay", "security_version", "incompatible", "extra", "hash", "oversized"],
)
def test_refused_url_installs_leave_nothing_in_downloads(
    committed: tuple[Fleet, dict[str, Path]], tmp_path: Path, bundle_server: BundleServer, kind: str
) -> None:
    fleet, bundles = committed
    state = tmp_path / "state"
    shutil.copytree(fleet.state, state, symlinks=True)
    url = bundle_server.add(f"/{kind}.esb", bundles[kind].read_bytes())
    options: dict[str, object] = {}
    if kind == "hash":
        options["sha256"] = "0" * 64
    if kind == "oversized":
        options["policy"] = Policy(max_unpacked_bytes=MB)
    before = _state_tree(state)
    for attempt in range(3):
        outcome = install(state, url, **options)
        assert outcome.state == "FAILED" and outcome.code == kind, outcome
        assert "\n" not in outcome.reason
        assert downloads(state) == [], f"attempt {attempt + 1} left {downloads(state)}"
        assert _state_tree(state) == before
    assert len(bundle_server.requests(f"/{kind}.esb")) == 3  # downloaded every time: refused after it
    assert Store(state).active().label == "vision v5"  # type: ignore[union-attr]


def test_a_failed_or_cancelled_download_leaves_nothing(tmp_path: Path, bundle_server: BundleServer) -> None:
    fleet = make_fleet(tmp_path)
    data = fleet.bundle(1, extra={"mlp/1/pad.bin": os.urandom(2 * MB)}).read_bytes()
    gone = bundle_server.add("/gone.esb", data, status=404)
    assert install(fleet.state, gone).code == "download" and downloads(fleet.state) == []
    cancel = threading.Event()

    def report(state: str, progress: float | None, message: str) -> None:
        if state == "DOWNLOADING" and message.endswith(" bytes") and int(message.split()[0]) > MB // 2:
            cancel.set()  # half-way through the download

    slow = bundle_server.add("/slow.esb", data)
    outcome = installer(fleet.state).install(slow, report, cancel=cancel)
    assert outcome.state == "FAILED" and "cancelled" in outcome.reason and downloads(fleet.state) == []


# ------------------------------------------------------------------------------------------------- gc
def test_gc_removes_stale_downloads_but_never_the_one_in_progress(
    tmp_path: Path, bundle_server: BundleServer
) -> None:
    fleet = make_fleet(tmp_path)
    store = Store(fleet.state)
    store.ensure()
    stale = ["0123abcd.esb.part", "0123abcd.esb.part.meta", "old.esb", "junk.tmp"]
    for name in stale:
        (store.downloads / name).write_bytes(os.urandom(64 * 1024))
    (store.downloads / "leftover").mkdir()
    (store.downloads / "leftover" / "x").write_bytes(b"x")
    removed = store.gc()
    assert sorted(removed) == sorted(f"downloads/{n}" for n in [*stale, "leftover"])
    assert downloads(fleet.state) == []

    # A real download, held mid-way by the server: gc spares it; a gc under the store lock is refused.
    data = fleet.bundle(1, extra={"mlp/1/pad.bin": os.urandom(2 * MB)}).read_bytes()
    url = bundle_server.add("/v1.esb", data, stall_after=MB, stall_s=30)
    cancel = threading.Event()
    outcomes: list[Outcome] = []

    def run() -> None:
        outcomes.append(installer(fleet.state).install(url, lambda *a: None, cancel=cancel))

    worker = threading.Thread(target=run)
    worker.start()
    try:
        wait_until(lambda: _part_size(store) >= MB, 60, "the download to get going")
        part = next(store.downloads.glob("*.part"))
        (store.downloads / "stale.esb.part").write_bytes(b"stale")
        removed = store.gc()  # as recovery or a careless caller would, without the lock
        assert removed == ["downloads/stale.esb.part"] and part.exists()
        with pytest.raises(StoreError, match="another install or rollback is running"), store.lock():
            pass  # the fleet's gc takes this lock first
    finally:
        cancel.set()
        bundle_server.stop()  # wakes the stalled response
        worker.join(120)
    assert outcomes and outcomes[0].state == "FAILED"
    assert downloads(fleet.state) == []


def _part_size(store: Store) -> int:
    part = next(store.downloads.glob("*.part"), None)
    try:
        return part.stat().st_size if part is not None else 0
    except FileNotFoundError:
        return 0


def test_a_download_cut_by_a_restart_is_kept_for_its_resume_only(tmp_path: Path) -> None:
    fleet = make_fleet(tmp_path)
    store = Store(fleet.state)
    store.ensure()
    record = store.begin("https://mirror.lan/v2.esb", download="feed.esb")
    (store.downloads / "feed.esb.part").write_bytes(os.urandom(1000))
    (store.downloads / "feed.esb.part.meta").write_text(json.dumps({"url": "https://mirror.lan/v2.esb"}))
    (store.downloads / "other.esb.part").write_bytes(b"x")
    assert record["state"] == "DOWNLOADING"
    with store.lock():
        recover(store)  # the next start: the install is FAILED, its partial download kept to resume
    assert downloads(fleet.state) == ["feed.esb.part", "feed.esb.part.meta"]
    assert store.gc() == []
    assert store.gc(keep_resumable=False) == ["downloads/feed.esb.part", "downloads/feed.esb.part.meta"]


# ------------------------------------------------------------------------------------------ free space
def test_a_download_that_cannot_fit_is_refused_on_a_small_disk(
    tmp_path: Path, bundle_server: BundleServer
) -> None:
    fleet = make_fleet(tmp_path / "fleet")
    data = fleet.bundle(1, extra={"mlp/1/pad.bin": os.urandom(6 * MB)}).read_bytes()
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        if isinstance(disk, str):
            pytest.skip(disk)  # the statvfs seam test below covers the preflight then
        state = disk / "state"
        shutil.copytree(fleet.state, state)
        margin = Policy(disk_margin_bytes=256 * 1024)
        # Content-Length declared: refused before a byte is written.
        url = bundle_server.add("/big.esb", data)
        outcome = install(state, url, policy=margin)
        assert outcome.code == "disk" and "not enough disk for downloading" in outcome.reason, outcome
        assert str(len(data) + 256 * 1024) in outcome.reason and downloads(state) == []
        assert len(bundle_server.requests("/big.esb")) == 1  # refused, not retried
        # No length declared (chunked): the disk fills, the write fails, the partial file is deleted.
        chunked = bundle_server.add("/chunked.esb", data, chunked=True)
        outcome = install(state, chunked, policy=margin)
        assert outcome.code == "disk" and "disk full while writing" in outcome.reason, outcome
        assert downloads(state) == [] and shutil.disk_usage(disk).used < MB
        # Not even the margin is free: refused before connecting.
        outcome = install(state, bundle_server.add("/any.esb", data), policy=Policy(disk_margin_bytes=8 * MB))
        assert outcome.code == "disk" and bundle_server.requests("/any.esb") == []


def test_download_preflight_through_the_statvfs_seam(
    fleet: Fleet, bundle_server: BundleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no tmpfs can be mounted: statvfs says 5 MiB are free; a 6 MiB download is refused at once."""
    data = fleet.bundle(1, extra={"mlp/1/pad.bin": os.urandom(6 * MB)}).read_bytes()
    asked: list[Path] = []

    def free(path: Path) -> int:
        asked.append(path)
        return 5 * MB

    monkeypatch.setattr(policy_module, "free_bytes", free)
    url = bundle_server.add("/big.esb", data)
    outcome = install(fleet.state, url, policy=Policy(disk_margin_bytes=MB))
    assert outcome.code == "disk" and f"need {len(data) + MB} bytes" in outcome.reason, outcome
    assert asked == [fleet.state / "ota" / "downloads"] * 2  # before the start, then with the length
    assert downloads(fleet.state) == [] and len(bundle_server.requests("/big.esb")) == 1
