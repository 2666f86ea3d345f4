"""systemd/edgeserve.service and its drop-ins: `systemd-analyze verify` is clean, the policy holds.

`verify` refuses a unit whose ExecStart binary is missing, and /opt/edgeserve/venv is not installed
on a CI box: the unit is verified as a copy whose ExecStart names a stand-in executable (same
arguments), and the untouched unit is checked to fail for that one reason only. Works as root in a
container without systemd as PID 1 (verify and `security --offline` only read files).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeserve.config import ServerSection, load_settings

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "edgeserve.service"
DROP_INS = sorted((SYSTEMD / "drop-ins").glob("*.conf"))
EXEC = "/opt/edgeserve/venv/bin/edgeserve"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(
    ANALYZE is None,
    reason="systemd-analyze is not installed (apt-get install systemd; scripts/test.sh does it)",
)

ENV = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C"}


# --- a small unit-file reader: [(section, key, value)] in file order, drop-ins after the unit ----------


def entries(*paths: Path) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for path in paths:
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            assert not line.endswith("\\"), f"{path.name}: keep one setting per line: {line}"
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not key=value: {line}"
            out.append((section, key.strip(), value.strip()))
    return out


def values(items: list[tuple[str, str, str]], key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in items if s == section and k == key]


def last(items: list[tuple[str, str, str]], key: str, section: str = "Service") -> str | None:
    found = values(items, key, section)
    return found[-1] if found else None


def seconds(value: str) -> float:
    """systemd time span: "45", "45s", "1min 30s", "2m"."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


# --- systemd-analyze ---------------------------------------------------------------------------------


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, env=ENV, timeout=60, check=False)


def staged_unit(tmp: Path, drop_in: Path | None = None, *, stand_in: bool = True) -> Path:
    """The unit (+ a drop-in as edgeserve.service.d/<name>.conf) in a fresh folder, for verify."""
    text = UNIT.read_text()
    if stand_in:
        fake = tmp / "venv" / "bin" / "edgeserve"
        fake.parent.mkdir(parents=True)
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
        assert text.count(EXEC) == 1
        text = text.replace(EXEC, str(fake))
    unit = tmp / "edgeserve.service"
    unit.write_text(text)
    if drop_in is not None:
        (tmp / "edgeserve.service.d").mkdir()
        shutil.copy(drop_in, tmp / "edgeserve.service.d" / drop_in.name)
    return unit


def test_there_is_a_drop_in_per_accelerator() -> None:
    assert {p.name for p in DROP_INS} >= {"jetson.conf", "nvidia.conf", "inferentia.conf", "intel.conf"}


@pytest.mark.parametrize("drop_in", [None, *DROP_INS], ids=lambda p: p.name if p else "unit")
def test_verify_is_clean(tmp_path: Path, drop_in: Path | None) -> None:
    unit = staged_unit(tmp_path, drop_in)
    result = analyze("verify", "--man=no", str(unit))
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    assert output == "", f"systemd-analyze verify warned:\n{output}"


def test_verify_of_the_installed_path_fails_only_for_the_missing_venv(tmp_path: Path) -> None:
    if Path(EXEC).exists():
        pytest.skip(f"{EXEC} exists here; the stand-in copy is what the other tests verify")
    unit = staged_unit(tmp_path, stand_in=False)
    result = analyze("verify", "--man=no", str(unit))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode != 0
    assert lines and all(f"Command {EXEC} is not executable" in line for line in lines), lines


def test_drop_in_is_applied(tmp_path: Path) -> None:
    """verify reads edgeserve.service.d/ next to the unit: a broken drop-in must be reported."""
    bad = tmp_path / "bad.conf"
    bad.write_text("[Service]\nNoSuchSetting=1\n")
    stage = tmp_path / "stage"
    stage.mkdir()
    unit = staged_unit(stage, bad)
    result = analyze("verify", "--man=no", str(unit))
    assert "NoSuchSetting" in result.stdout + result.stderr


def security(tmp: Path, drop_in: Path | None) -> tuple[float, str]:
    unit = staged_unit(tmp, drop_in)
    result = analyze("security", "--offline=true", "--no-pager", str(unit))
    text = result.stdout + result.stderr
    if "--offline" in text and ("unrecognized" in text or "unknown option" in text):
        pytest.skip("systemd-analyze security --offline needs systemd >= 252")
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", text)
    assert match, text
    return float(match.group(1)), text


@pytest.mark.parametrize("drop_in", [None, *DROP_INS], ids=lambda p: p.name if p else "unit")
def test_security_exposure_stays_low(tmp_path: Path, drop_in: Path | None) -> None:
    # 1.6 when written (systemd 252); what stays exposed and why: docs/systemd.md.
    score, text = security(tmp_path, drop_in)
    assert score <= 2.0, text


def test_security_sees_the_drop_in_devices(tmp_path: Path) -> None:
    _, text = security(tmp_path, SYSTEMD / "drop-ins" / "intel.conf")
    device_line = next(line for line in text.splitlines() if "DeviceAllow=" in line)
    assert "char-drm:rw" in device_line and "char-accel:rw" in device_line, device_line


# --- policy ------------------------------------------------------------------------------------------


def test_service_policy() -> None:
    items = entries(UNIT)
    assert last(items, "Type") == "notify"
    assert last(items, "NotifyAccess") == "main"  # the server child never notifies
    assert last(items, "KillMode") == "mixed"  # SIGTERM to the supervisor only, it drains the child
    assert seconds(last(items, "WatchdogSec") or "0") == 30
    assert last(items, "Restart") == "on-failure"
    assert last(items, "RestartSec") and values(items, "StartLimitBurst", "Unit")
    assert last(items, "DevicePolicy") == "closed"
    assert last(items, "User") == "edgeserve" and last(items, "Group") == "edgeserve"
    assert last(items, "ProtectSystem") == "strict"
    assert last(items, "NoNewPrivileges") == "yes"
    assert last(items, "PrivateTmp") == "yes"
    assert last(items, "CapabilityBoundingSet") == ""
    assert last(items, "LimitMEMLOCK") == "infinity"
    assert last(items, "StateDirectory") == "edgeserve"
    assert last(items, "RuntimeDirectory") == "edgeserve"
    assert last(items, "ConfigurationDirectory") == "edgeserve"
    assert (last(items, "ExecReload") or "").split() == ["/bin/kill", "-HUP", "$MAINPID"]
    # A CPU box may lack the render group: the groups come with the accelerator drop-ins.
    assert not values(items, "SupplementaryGroups")


def test_stop_timeout_covers_the_drain() -> None:
    drain = ServerSection().exit_timeout_s
    stop = seconds(last(entries(UNIT), "TimeoutStopSec") or "0")
    assert stop >= drain + 10, f"TimeoutStopSec={stop}s leaves no margin over exit_timeout_s={drain}s"
    assert seconds(last(entries(UNIT), "TimeoutStartSec") or "0") >= 60


@pytest.mark.parametrize("path", [UNIT, *DROP_INS], ids=lambda p: p.name)
def test_accelerators_stay_reachable(path: Path) -> None:
    items = entries(path)
    # PrivateDevices hides the GPUs; MemoryDenyWriteExecute breaks JIT runtimes (CUDA, OpenVINO).
    assert values(items, "PrivateDevices") in ([], ["no"])
    assert values(items, "MemoryDenyWriteExecute") in ([], ["no"])
    assert values(items, "PrivateUsers") in ([], ["no"])
    # Only the unit decides the policy; a drop-in adds devices and groups.
    if path != UNIT:
        assert not values(items, "DevicePolicy")


@pytest.mark.parametrize("path", [UNIT, *DROP_INS], ids=lambda p: p.name)
def test_device_allow_has_no_glob_on_dev_paths(path: Path) -> None:
    for value in values(entries(path), "DeviceAllow"):
        node, _, access = value.partition(" ")
        assert access.strip() in ("r", "rw", "rwm", "w"), value
        if node.startswith("/dev/"):
            assert not re.search(r"[*?\[\]]", node), (
                f"{path.name}: DeviceAllow takes no glob on a path: {value}"
            )
        else:
            assert re.fullmatch(r"(char|block)-[\w.*?+-]+", node), f"{path.name}: {value}"


def test_drop_ins_allow_their_devices() -> None:
    def allowed(name: str) -> list[str]:
        return [v.split()[0] for v in values(entries(SYSTEMD / "drop-ins" / name), "DeviceAllow")]

    jetson = allowed("jetson.conf")
    for node in (
        "nvmap",
        "nvhost-ctrl",
        "nvhost-ctrl-gpu",
        "nvhost-gpu",
        "nvhost-as-gpu",
        "nvhost-nvdla0",
        "nvhost-ctrl-nvdla1",
        "nvhost-vic",
        "nvhost-nvdec",
    ):
        assert f"/dev/{node}" in jetson
    nvidia = allowed("nvidia.conf")
    for node in ("nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        assert f"/dev/{node}" in nvidia
    assert "char-nvidia*" in nvidia
    assert allowed("inferentia.conf") == ["char-neuron"]  # /proc/devices name of the Neuron driver
    assert set(allowed("intel.conf")) == {"char-drm", "char-accel"}


def test_exec_start_uses_the_shipped_settings() -> None:
    exec_start = (last(entries(UNIT), "ExecStart") or "").split()
    assert exec_start[:2] == [EXEC, "run"]
    config = Path(exec_start[exec_start.index("--config") + 1])
    assert config == Path("/etc/edgeserve/edgeserve.toml")  # ConfigurationDirectory=edgeserve
    settings = load_settings(SYSTEMD / "edgeserve.toml", environ={})
    # PrivateTmp=yes: a socket in /tmp would be private to the service.
    assert settings.zmq.endpoints and all(
        e.startswith("ipc:///run/edgeserve/") or not e.startswith("ipc://") for e in settings.zmq.endpoints
    )
    assert settings.server.exit_timeout_s == ServerSection().exit_timeout_s
    assert str(settings.server.model_repository).startswith("/var/lib/edgeserve/")
    assert str(settings.runtime.cache_dir) == "/var/cache/edgeserve"  # CacheDirectory=edgeserve


def test_trusted_keys_are_read_only_to_the_service() -> None:
    """The key folders live under /etc/edgeserve, which the service may read and never write: a
    fleet command or a log line cannot turn into a trusted key."""
    items = entries(UNIT)
    settings = load_settings(SYSTEMD / "edgeserve.toml", environ={})
    trust = settings.ota.trust_dir
    assert trust is not None and trust.is_relative_to("/etc/edgeserve"), trust
    assert last(items, "ConfigurationDirectory") == "edgeserve"  # root-owned, unlike StateDirectory=
    read_only = [Path(p.lstrip("-")) for v in values(items, "ReadOnlyPaths") for p in v.split()]
    assert any(trust.is_relative_to(p) for p in read_only), read_only
    writable = [Path(p.lstrip("-")) for v in values(items, "ReadWritePaths") for p in v.split()]
    assert not any(trust.is_relative_to(p) or p.is_relative_to(trust) for p in writable), writable
    assert last(items, "ProtectSystem") == "strict"
    assert settings.logging.file is None or not settings.logging.file.is_relative_to(trust)


def test_secrets_come_from_a_root_only_file_not_the_group_readable_settings() -> None:
    """Camera clients are in group edgeserve and can read edgeserve.toml: tokens and passwords go in
    the optional EnvironmentFile (root-only, read by systemd), and the shipped settings carry none."""
    items = entries(UNIT)
    assert "-/etc/edgeserve/secrets.env" in values(items, "EnvironmentFile")
    settings = load_settings(SYSTEMD / "edgeserve.toml", environ={})
    assert not settings.http.token and not settings.grpc.token and not settings.fleet.password
    assert "secrets.env" in (ROOT / "docs" / "systemd.md").read_text()  # the install steps say so


def test_sysusers_creates_the_service_user(tmp_path: Path) -> None:
    text = (SYSTEMD / "edgeserve.sysusers").read_text()
    assert re.search(r"^u edgeserve\s", text, re.M)
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        return
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [sysusers, "--dry-run", f"--root={tmp_path}", str(SYSTEMD / "edgeserve.sysusers")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Creating user 'edgeserve'" in output and "Creating group 'edgeserve'" in output, output
