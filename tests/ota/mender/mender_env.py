"""The real Mender client (Debian's mender-client 3.4, standalone mode) on a test-private device.

mender 3.x looks for Update Modules only in /usr/share/mender/modules/v3 and reads /etc/mender/artifact_info,
neither of which it lets a flag move; so every `mender` runs in a private mount namespace (`unshare -m`)
where a test folder is bind-mounted over each: the system's folders are never touched, and tests can run
side by side. `--config` and `--data` put the client's settings and database in the test folder too. The
module is installed with ota/mender/install.sh, as on a device.

    env = MenderEnv(tmp, state_dir, device_type="edge-x86")
    env.mender("install", artifact)  ->  CompletedProcess;  env.artifact_name(), env.provides()
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
INSTALL = ROOT / "ota" / "mender" / "install.sh"
SYSTEM_MODULES = Path("/usr/share/mender/modules/v3")
SYSTEM_ETC = Path("/etc/mender")


@functools.cache
def unavailable() -> str | None:
    """Why the Mender tests cannot run here (None: they can)."""
    for tool in ("mender", "mender-artifact"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/test.sh installs mender-client and mender-artifact)"
    if shutil.which("unshare") is None or not SYSTEM_MODULES.is_dir():
        return "unshare or /usr/share/mender/modules/v3 is missing"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind /tmp {SYSTEM_MODULES}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"no private mount namespace here (unshare -m as root is needed): {probe.stderr.strip()}"
    return None


@functools.cache
def serving_v1() -> Any:
    """A signing key and a device state folder serving vision v1, made once per test run (an install costs a
    trial server) and shared by the Mender test modules; copy `.state` before changing it."""
    import atexit
    import tempfile

    from ota_fixtures import edgeserve, make_fleet

    folder = Path(tempfile.mkdtemp(prefix="edgeserve-mender-v1-"))
    atexit.register(shutil.rmtree, folder, True)
    fleet = make_fleet(folder)
    edgeserve("bundle", "install", str(fleet.bundle(1)), "--state-dir", str(fleet.state), check=True)
    return fleet


def fleet_fixture() -> Any:
    """A test file's `fleet` fixture (`fleet = fleet_fixture()`): a copy of `serving_v1()` per test."""
    import pytest

    @pytest.fixture
    def fleet(tmp_path: Path) -> Any:
        return copy_of_v1(tmp_path)

    return fleet


def copy_of_v1(tmp: Path) -> Any:
    """A Fleet whose state folder is a copy of `serving_v1()`'s under `tmp`, for one test to change."""
    from ota_fixtures import Fleet

    template = serving_v1()
    state = tmp / "state"
    shutil.copytree(template.state, state, symlinks=True)  # the store's links are relative
    return Fleet(tmp, template.key, template.public, state)


class MenderEnv:
    def __init__(self, tmp: Path, state_dir: Path, *, device_type: str = "edge-x86") -> None:
        self.tmp = tmp
        self.state_dir = state_dir
        self.root = tmp / "device-root"  # what install.sh writes: the module, the inventory script
        subprocess.run(
            [
                str(INSTALL),
                "--python",
                sys.executable,
                "--root",
                str(self.root),
                "--state-dir",
                str(state_dir),
                "--init-mender",
                device_type,
            ],
            check=True,
            capture_output=True,
        )
        self.modules = self.root / "usr/share/mender/modules/v3"
        self.etc = self.root / "etc/mender"
        self.data = tmp / "mender-data"
        self.data.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.root / "var/lib/mender/device_type", self.data / "device_type")
        self.conf = tmp / "mender.conf"
        self.conf.write_text("{}\n")
        self.module_conf = self.root / "etc/edgeserve/mender.toml"

    def set_verify_key(self, public_pem: Path) -> None:
        """Make the client require artifacts signed by this key (Mender's own signature)."""
        self.conf.write_text(json.dumps({"ArtifactVerifyKey": str(public_pem)}) + "\n")

    def command(self, *args: str) -> list[str]:
        mounts = f"mount --bind {self.modules} {SYSTEM_MODULES} && mount --bind {self.etc} {SYSTEM_ETC}"
        mender = " ".join(
            ["exec mender --no-syslog --config", str(self.conf), "--data", str(self.data), *args]
        )
        return ["unshare", "-m", "sh", "-c", f"{mounts} && {mender}"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "EDGESERVE_MENDER_CONF": str(self.module_conf),
            "EDGESERVE_OTA_TRIAL_WINDOW_S": "1",
            **(extra or {}),
        }

    def mender(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(env),
            check=False,
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """`mender ...` in the background (kill_tree() ends it with all it started)."""
        return subprocess.Popen(
            self.command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env(env),
            start_new_session=True,
        )

    def artifact_name(self) -> str:
        return self.mender("show-artifact").stdout.strip()

    def provides(self) -> dict[str, str]:
        lines = self.mender("show-provides").stdout.splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)


def kill_tree(pid: int) -> None:
    """A power cut for a process tree: every process stops before any dies.

    Killing one by one lets a parent run between its child's death and its own: `mender` could see its
    module die and end the deployment (remove its work tree), which no power cut does. That is the likely
    cause of a failure seen once on a saturated box: the next `mender rollback` could not run the module
    ("fork/exec ...: no such file", Go's words for a missing working folder). So the root is frozen
    first (it can start nothing more), then its descendants, then all get SIGKILL."""
    import psutil

    root = psutil.Process(pid)
    frozen: list[psutil.Process] = []
    found = [root]
    while found:  # a child may have started one more before it froze: look again until none is new
        for process in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.suspend()
        frozen += found
        found = []
        with contextlib.suppress(psutil.NoSuchProcess):
            found = [p for p in root.children(recursive=True) if p not in frozen]
    for process in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    root.wait(10)


def wait_file(path: Path, timeout: float, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process is not None and process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise AssertionError(f"exited ({process.returncode}) before {path} appeared: {output}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def wrap(bundle: Path, device_type: str = "edge-x86", *extra: str) -> Path:
    """The bundle as a Mender artifact, made with `edgeserve bundle mender-wrap`."""
    out = bundle.with_suffix(f".{device_type}.mender")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeserve",
            "bundle",
            "mender-wrap",
            str(bundle),
            "--device-type",
            device_type,
            "--out",
            str(out),
            *extra,
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return out


def raw_artifact(bundle: Path, name: str, device_type: str = "edge-x86", *extra: str) -> Path:
    """The artifact made with mender-artifact alone, as the fixed contract says it can be."""
    out = bundle.with_suffix(".raw.mender")
    subprocess.run(
        [
            "mender-artifact",
            "write",
            "module-image",
            "-T",
            "edgeserve-bundle",
            "-t",
            device_type,
            "-n",
            name,
            "-f",
            str(bundle),
            "-o",
            str(out),
            *extra,
        ],
        check=True,
        capture_output=True,
    )
    return out
