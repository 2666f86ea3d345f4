"""cgroup v1 and v2 CPU/memory limits change the CPU budget, the thread plan and memory checks."""

from __future__ import annotations

from pathlib import Path

from hw_helpers import PROFILES, copy_fixture, make_repository, settings

from edgeserve.hardware.plan import Planner
from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.profile import load_profiles, match_profile
from edgeserve.hardware.runtimes import inventory

RUNTIMES = inventory({"onnxruntime": "1.20.0", "openvino": "2024.4.0"})


def _planner(root: Path, tmp: Path, **runtime: object) -> Planner:
    hw = probe_hardware(root)
    profile = match_profile(hw, load_profiles(builtin=[PROFILES]))
    return Planner(hw, profile, RUNTIMES, settings(tmp, **runtime))


def _v2(root: Path, cpu_max: str, memory_max: str = "max", cpus: str | None = None) -> None:
    cg = root / "sys/fs/cgroup/system.slice/edgeserve.service"
    (cg / "cpu.max").write_text(cpu_max + "\n")
    (cg / "memory.max").write_text(memory_max + "\n")
    if cpus is not None:
        (cg / "cpuset.cpus.effective").write_text(cpus + "\n")


def test_no_limits_uses_online_cpus(tmp_path: Path) -> None:
    root = copy_fixture("x86-cpu", tmp_path)
    assert _planner(root, tmp_path).threads() == (8, "8 online CPUs")


def test_v2_quota_limits_threads(tmp_path: Path) -> None:
    root = copy_fixture("x86-cpu", tmp_path)
    _v2(root, "200000 100000", "1073741824")
    planner = _planner(root, tmp_path)
    threads, why = planner.threads()
    assert threads == 2 and "cgroup v2 CPU quota 2" in why
    assert planner.hw.budget.memory_bytes == 1 << 30
    assert planner.hw.cgroup.sources[0].endswith("cpu.max = 200000 100000")
    # fractional quotas round up; two instances share the budget
    _v2(root, "150000 100000")
    assert _planner(root, tmp_path).threads()[0] == 2
    assert _planner(root, tmp_path).threads(instances=2)[0] == 1


def test_v2_parent_limit_and_cpuset(tmp_path: Path) -> None:
    root = copy_fixture("x86-cpu", tmp_path)
    (root / "sys/fs/cgroup/system.slice/cpu.max").write_text("300000 100000\n")  # the slice caps its children
    _v2(root, "max 100000", cpus="0-5")
    threads, why = _planner(root, tmp_path).threads()
    assert threads == 3 and "quota 3" in why
    (root / "sys/fs/cgroup/system.slice/cpu.max").write_text("max 100000\n")
    threads, why = _planner(root, tmp_path).threads()
    assert threads == 6 and "cpuset" in why


def test_v2_namespaced_container(tmp_path: Path) -> None:
    """In a container /proc/self/cgroup says 0::/ and the limits sit at the cgroup mount's root."""
    root = copy_fixture("arm-rk3588", tmp_path)
    (root / "sys/fs/cgroup/cpu.max").write_text("100000 100000\n")
    (root / "sys/fs/cgroup/memory.max").write_text("536870912\n")
    planner = _planner(root, tmp_path)
    assert planner.threads()[0] == 1
    assert planner.hw.budget.memory_bytes == 512 << 20


def test_v1_limits(tmp_path: Path) -> None:
    root = copy_fixture("jetson-xavier-nano", tmp_path)
    assert _planner(root, tmp_path).threads()[0] == 3  # 4 CPUs, 1 reserved by the profile
    (root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us").write_text("200000\n")
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(str(768 << 20) + "\n")
    planner = _planner(root, tmp_path)
    threads, why = planner.threads()
    assert threads == 1 and "cgroup v1 CPU quota 2" in why  # 2 CPUs by quota, minus the reserved core
    assert planner.hw.cgroup.version == 1 and planner.hw.budget.memory_bytes == 768 << 20


def test_v1_nested_path(tmp_path: Path) -> None:
    root = copy_fixture("jetson-xavier-nano", tmp_path)
    (root / "proc/self/cgroup").write_text("12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n")
    nested = root / "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    nested.mkdir(parents=True)
    (nested / "cpu.cfs_quota_us").write_text("100000\n")
    (nested / "cpu.cfs_period_us").write_text("100000\n")
    assert probe_hardware(root).budget.effective_cpus == 1


def test_settings_threads_override(tmp_path: Path) -> None:
    root = copy_fixture("x86-cpu", tmp_path)
    _v2(root, "200000 100000")
    assert _planner(root, tmp_path, cpu_threads=5).threads() == (5, "settings runtime.cpu_threads")


def test_memory_limit_rejects_big_models(tmp_path: Path) -> None:
    root = copy_fixture("x86-cpu", tmp_path)
    repo = make_repository(tmp_path)
    _v2(root, "max 100000", str((512 << 20) + 200_000))  # x86-cpu keeps 512 MiB headroom
    plan = _planner(root, tmp_path).plan_model("big", repo / "big" / "1", None)
    assert plan.chosen is None
    assert all("MiB left after 512 MiB headroom (cgroup v2 memory limit)" in v.reason for v in plan.rejected)
    assert plan.options is None and plan.error and "no option can run it here" in plan.error
