"""What the service runs, the service group cannot change (issue 33, item 1).

The appliance runs as the systemd unit sets it up: `UMask=0007` and group `edgeserve` (here a fresh group,
with a second user in it: a camera pipeline's user), its state folder 0750 owned by that group. A
signed bundle whose Python model answers 42 is installed through the running appliance. The attack as
the issue describes it: the group member renames the active bundle's model.py away, puts its own in
place (which writes a marker and answers 1337) and asks for a reload over loopback.

- As the group member, every write is refused (EACCES): the bundle's model.py, a new module or
  `__pycache__` beside it, the `ota/current` link, the journal, the caches, the overrides, the fleet
  ledger folder and the settings overlay; folders an earlier release left 0770 are tightened at start;
  nothing under the state folder is group- or other-writable. The reload it asks for serves 42.
- Forced as root anyway (each way a file can be swapped: replaced by rename, rewritten in place, a
  module or `__pycache__` added, a link, `ota/current` pointed at a copy outside the store whose
  manifest lists the new file), the reload fails naming the file, the model still answers 42, the
  attacker's code never ran, and `edgeserve bundle status` names the file. Undone, the reload works.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bundle_helpers import Appliance, start_appliance
from group_member_helpers import Member, run_as, service_group
from ota_fixtures import FAST, Fleet, edgeserve, make_fleet

from edgeserve.ota.build import BuildRequest, build_bundle

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"), reason="needs root and useradd"),
]

MODEL = "answer"
CONFIG = """
backend: "python"
max_batch_size: 0
input { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }
output { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }
instance_group { kind: KIND_CPU count: 1 }
"""
ANSWER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full([1], {value}, np.float32))])
                for _ in requests]
"""
EVIL_PREFIX = "import pathlib\npathlib.Path({marker!r}).write_text('the attacker ran')\n"
SIGNED = ANSWER.replace("{value}", "42") + "# " + "-" * 400 + "\n"  # longer than the attacker's file


@dataclass
class Device:
    appliance: Appliance
    member: Member
    state: Path
    marker: Path  # the attacker's model.py writes it when imported

    @property
    def bundle(self) -> Path:
        return self.state / "ota" / "bundles" / "answers-v1"

    @property
    def version_dir(self) -> Path:
        return self.bundle / "models" / MODEL / "1"

    def evil_source(self, size: int = 0) -> str:
        """The attacker's model.py (padded with a comment to `size` bytes)."""
        text = EVIL_PREFIX.format(marker=str(self.marker)) + ANSWER.replace("{value}", "1337")
        return text + ("#" * (size - len(text) - 1) + "\n" if size else "")

    def ask(self) -> float:
        body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [0.0]}]}
        status, answer = self.request("POST", f"/v2/models/{MODEL}/infer", body)
        assert status == 200, answer
        return float(answer["outputs"][0]["data"][0])

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """One request over loopback, sent by the group member's own process."""
        port = self.appliance.http_port
        step: dict[str, Any] = {"do": "http", "port": port, "method": method, "path": path}
        if body is not None:
            step["body"] = body
        (answer,) = run_as(self.member.user, [step])
        assert answer.get("ok"), answer
        return int(answer["status"]), answer["body"]

    def reload(self) -> tuple[int, str]:
        status, body = self.request("POST", f"/v2/repository/models/{MODEL}/load", {})
        return status, (body or {}).get("error", "") if isinstance(body, dict) else str(body)


@contextlib.contextmanager
def as_the_unit(gid: int) -> Iterator[None]:
    """What the unit's `UMask=0007` and `Group=` give the processes started meanwhile."""
    umask = os.umask(0o007)
    os.setegid(gid)
    try:
        yield
    finally:
        os.setegid(0)
        os.umask(umask)


def _bundle(fleet: Fleet) -> Path:
    repo = fleet.tmp / "bundle-repo"
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)
    (repo / MODEL / "1" / "model.py").write_text(SIGNED)
    out = fleet.tmp / "answers-v1.esb"
    build_bundle(BuildRequest(repo, "answers", 1, fleet.key, out))
    return out


def _earlier_release(state: Path, gid: int) -> list[Path]:
    """What an earlier release left under UMask=0007: group-writable folders and files."""
    made = []
    for folder in ("ota", "cache", "cache/openvino", "overrides", "fleet"):
        (state / folder).mkdir()
        made.append(state / folder)
    (state / "fleet" / "settings.toml").write_text("# set_config\n")
    made.append(state / "fleet" / "settings.toml")
    for path in made:
        os.chown(path, 0, gid)
        path.chmod(0o770 if path.is_dir() else 0o660)
    return made


@pytest.fixture(scope="module")
def device() -> Iterator[Device]:
    with service_group() as member:
        public = Path(tempfile.mkdtemp(prefix="edgeserve-a1-", dir="/tmp"))
        public.chmod(0o755)  # the member reaches what the modes below let it (as /var/lib does)
        try:
            fleet = make_fleet(public)
            state = fleet.state
            os.chown(state, 0, member.gid)
            state.chmod(0o750)  # StateDirectoryMode=0750, group edgeserve
            leftovers = _earlier_release(state, member.gid)
            esb = _bundle(fleet)
            (public / "repo").mkdir()
            with as_the_unit(member.gid):
                appliance = start_appliance(public / "repo", public, env=FAST)
            try:
                appliance.wait_ready(timeout=180)  # a loaded box: the runtimes' imports take a while
                installed = edgeserve("bundle", "install", str(esb), "--state-dir", str(state), timeout=400)
                assert installed.returncode == 0, installed.stdout + installed.stderr + appliance.log()
                device = Device(appliance, member, state, public / "attacker.ran")
                assert device.ask() == 42.0
                for path in leftovers:
                    assert not path.stat().st_mode & 0o022, f"{path} left group-writable"
                yield device
            finally:
                appliance.stop()
        finally:
            shutil.rmtree(public, ignore_errors=True)


def _writable_by_others(state: Path) -> list[str]:
    found = []
    for path in [state, *state.rglob("*")]:
        mode = path.lstat().st_mode
        if (stat.S_ISDIR(mode) or stat.S_ISREG(mode)) and mode & 0o022:
            found.append(f"{path.relative_to(state)} {oct(stat.S_IMODE(mode))}")
    return found


def test_a_group_member_cannot_change_what_the_service_runs(device: Device) -> None:
    model_py = device.version_dir / "model.py"
    ota = device.state / "ota"
    evil = device.evil_source()
    attempts = [
        {"do": "rename", "src": str(model_py), "dst": str(model_py) + ".orig"},
        {"do": "write", "path": str(model_py), "data": evil},
        {"do": "write", "path": str(device.version_dir / "helper.py"), "data": evil},
        {"do": "mkdir", "path": str(device.version_dir / "__pycache__")},
        {"do": "swap_link", "link": str(ota / "current"), "target": "/tmp"},
        {"do": "write", "path": str(ota / "journal.json"), "data": "{}"},
        {"do": "write", "path": str(device.state / "cache" / "openvino" / "model.blob"), "data": evil},
        {"do": "mkdir", "path": str(device.state / "overrides" / MODEL)},
        {"do": "write", "path": str(device.state / "fleet" / "commands.json"), "data": "{}"},
        {"do": "write", "path": str(device.state / "fleet" / "settings.toml"), "data": "[server]\n"},
        {"do": "rename", "src": str(device.state / "fleet"), "dst": str(device.state / "fleet.old")},
    ]
    answers = run_as(device.member.user, attempts)
    for attempt, answer in zip(attempts, answers, strict=True):
        assert answer.get("error") == "EACCES", (attempt, answer)
    assert _writable_by_others(device.state) == []

    status, message = device.reload()  # what the member asks for over loopback
    assert status == 200, message
    assert device.ask() == 42.0
    assert not device.marker.exists()
    assert not (device.version_dir / "__pycache__").exists()  # the server wrote no bytecode there


def _replace_by_rename(device: Device) -> Callable[[], None]:
    model_py = device.version_dir / "model.py"
    model_py.rename(model_py.with_name("model.py.orig"))
    model_py.write_text(device.evil_source())

    def undo() -> None:
        model_py.with_name("model.py.orig").rename(model_py)

    return undo


def _rewrite_in_place(device: Device) -> Callable[[], None]:
    model_py = device.version_dir / "model.py"
    signed, st = model_py.read_bytes(), model_py.stat()
    # The same inode, size and mtime as the signed file: only the content (and the ctime) tell.
    with open(model_py, "r+b") as fh:
        fh.write(device.evil_source(len(signed)).encode())
    assert model_py.stat().st_size == len(signed)
    os.utime(model_py, ns=(st.st_atime_ns, st.st_mtime_ns))

    def undo() -> None:
        model_py.write_bytes(signed)

    return undo


def _add(relative: str, in_model: bool = False) -> Callable[[Device], Callable[[], None]]:
    """A file added (in the version folder, or the model folder), with the folders it needs."""

    def attack(device: Device) -> Callable[[], None]:
        base = device.version_dir.parent if in_model else device.version_dir
        path = base / relative
        path.parent.mkdir(exist_ok=True)
        path.write_text(device.evil_source())

        def undo() -> None:
            path.unlink()
            if path.parent != base:
                path.parent.rmdir()

        return undo

    return attack


def _link(device: Device) -> Callable[[], None]:
    model_py = device.version_dir / "model.py"
    elsewhere = device.state.parent / "evil-model.py"
    elsewhere.write_text(device.evil_source())
    model_py.rename(model_py.with_name("model.py.orig"))
    model_py.symlink_to(elsewhere)

    def undo() -> None:
        model_py.unlink()
        model_py.with_name("model.py.orig").rename(model_py)
        elsewhere.unlink()

    return undo


def _current_elsewhere(device: Device) -> Callable[[], None]:
    """A copy of the store outside it: its manifest lists the attacker's model.py with its real hash."""
    import hashlib

    fake = device.state.parent / "fake" / "ota" / "bundles" / "answers-v1"
    shutil.copytree(device.bundle, fake, symlinks=True)
    evil = device.evil_source().encode()
    (fake / "models" / MODEL / "1" / "model.py").write_bytes(evil)
    manifest = json.loads((fake / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"].endswith("model.py"):
            entry["sha256"], entry["size"] = hashlib.sha256(evil).hexdigest(), len(evil)
    (fake / "manifest.json").write_text(json.dumps(manifest))
    current = device.state / "ota" / "current"
    signed = os.readlink(current)
    current.unlink()
    current.symlink_to(fake)

    def undo() -> None:
        current.unlink()
        current.symlink_to(signed)
        shutil.rmtree(device.state.parent / "fake")

    return undo


ATTACKS: dict[str, tuple[Callable[[Device], Callable[[], None]], str]] = {
    "replaced-by-rename": (_replace_by_rename, f"models/{MODEL}/1/model.py: changed"),
    "rewritten-in-place": (_rewrite_in_place, f"models/{MODEL}/1/model.py: changed (sha256"),
    "extra-module": (_add("helper.py"), f"models/{MODEL}/1/helper.py: a file the signed manifest does not"),
    "pycache": (_add("__pycache__/model.cpython-311.pyc"), f"models/{MODEL}/1/__pycache__/: a folder"),
    "link": (_link, f"models/{MODEL}/1/model.py: a link"),
    "new-version-folder": (_add("2/model.py", in_model=True), f"models/{MODEL}/2/: a folder the signed"),
    "current-outside-the-store": (_current_elsewhere, "ota/current points at"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_forced_swap_fails_the_load_naming_the_file(device: Device, attack: str) -> None:
    make, named = ATTACKS[attack]
    undo = make(device)
    try:
        status, message = device.reload()
        assert status == 403 and named in message, (status, message)
        assert device.ask() == 42.0  # the signed version keeps serving
        assert not device.marker.exists(), "the attacker's code ran"
        shown = edgeserve("bundle", "status", "--state-dir", str(device.state), check=True).stdout
        assert "DOES NOT MATCH" in shown and named.split(": ")[0] in shown, shown
    finally:
        undo()
    status, message = device.reload()
    assert status == 200, message
    assert device.ask() == 42.0
    assert not device.marker.exists()
