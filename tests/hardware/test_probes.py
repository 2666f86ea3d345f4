"""Probes over the captured fixture trees, and over broken ones: absent, never a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hw_helpers import FIXTURES, copy_fixture

from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.probes._fs import FsRoot, parse_cpu_list
from edgeserve.hardware.probes.nvidia import jetpack_for, l4t_from_release
from edgeserve.hardware.runtimes import detect_runtimes


def test_jetson_orin_nx() -> None:
    hw = probe_hardware(FIXTURES / "jetson-orin")
    assert hw.cpu.arch == "aarch64"
    assert hw.cpu.core_types == ("Cortex-A78AE",)
    assert {"neon", "dotprod", "fp16"} <= set(hw.cpu.isa)
    assert hw.cpu.online_cpus == 8
    j = hw.jetson
    assert j is not None
    assert (j.l4t, j.jetpack, j.tensorrt, j.cuda) == ("36.4.3", "6.2", "10.3", "12.6")
    assert (j.soc, j.soc_family, j.compute_capability) == ("tegra234", "Orin", "8.7")
    assert (j.p_number, j.module, j.dla_cores) == ("p3767-0000", "Jetson Orin NX 16GB", 2)
    assert j.gpu == "17000000.ga10b"
    assert hw.nvidia_dgpu is None
    assert hw.board.family == "jetson"
    assert hw.kernel == "5.15.148-tegra"
    assert [z.kind for z in hw.thermal][:2] == ["cpu-thermal", "gpu-thermal"]
    assert hw.thermal[0].temp_c == pytest.approx(48.5)
    assert hw.cgroup.version == 2


def test_jetson_nano_jp4() -> None:
    hw = probe_hardware(FIXTURES / "jetson-xavier-nano")
    j = hw.jetson
    assert j is not None
    assert (j.l4t, j.jetpack, j.tensorrt, j.soc, j.dla_cores) == ("32.7.1", "4.6.1", "8.2.1", "tegra210", 0)
    assert hw.cpu.core_types == ("Cortex-A57",)
    assert hw.cgroup.version == 1


def test_x86_dgpu() -> None:
    hw = probe_hardware(FIXTURES / "x86-nvidia-dgpu")
    assert hw.cpu.arch == "x86_64" and hw.cpu.has("avx2", "avx_vnni") and not hw.cpu.has("avx512")
    gpu = hw.nvidia_dgpu
    assert gpu is not None and gpu.driver == "550.54.14"
    assert [(g.name, g.bus, g.minor, g.compute_capability) for g in gpu.gpus] == [
        ("NVIDIA GeForce RTX 3080", "0000:01:00.0", 0, "8.6")
    ]
    assert gpu.device_nodes == ("/dev/nvidia0",)
    assert hw.jetson is None


def test_x86_cpu_isa() -> None:
    hw = probe_hardware(FIXTURES / "x86-cpu")
    assert hw.cpu.has("avx512", "avx512_vnni", "avx512_bf16", "amx", "amx_bf16", "amx_int8")
    assert hw.cpu.bf16 and hw.cpu.fp16
    assert hw.board.model == "SYS-E300-13AD"


def test_intel_gpu_npu() -> None:
    hw = probe_hardware(FIXTURES / "x86-intel-gpu-npu")
    assert [(g.node, g.driver, g.node_present) for g in hw.intel.gpus] == [
        ("/dev/dri/renderD128", "i915", True)
    ]
    assert [(n.node, n.driver) for n in hw.intel.npus] == [("/dev/accel/accel0", "intel_vpu")]
    assert not hw.cpu.bf16


def test_neuron_and_boards() -> None:
    inf = probe_hardware(FIXTURES / "aws-inferentia")
    assert inf.neuron is not None
    assert (inf.neuron.devices, inf.neuron.instance_type, inf.neuron.cores) == (
        ("/dev/neuron0",),
        "inf2.xlarge",
        2,
    )
    rpi = probe_hardware(FIXTURES / "arm-cpu")
    assert (rpi.board.family, rpi.board.soc, rpi.cpu.core_types) == (
        "raspberrypi",
        "bcm2712",
        ("Cortex-A76",),
    )
    rk = probe_hardware(FIXTURES / "arm-rk3588")
    assert (rk.board.family, rk.board.soc) == ("rockchip", "rk3588")
    assert rk.cpu.core_types == ("Cortex-A55", "Cortex-A76") and rk.cpu.online_cpus == 8


def test_runtimes_from_tree() -> None:
    orin = detect_runtimes(FIXTURES / "jetson-orin")
    assert orin.status("tensorrt").version == "10.3.0"
    assert orin.status("onnxruntime").distribution == "onnxruntime-gpu"
    assert "TensorrtExecutionProvider" in orin.ort_providers()
    assert not orin.status("openvino").available
    cpu = detect_runtimes(FIXTURES / "x86-cpu")
    assert cpu.ort_providers() == ("CPUExecutionProvider",)
    assert cpu.status("openvino").version == "2024.4.0"


def test_empty_root_is_all_absent(tmp_path: Path) -> None:
    hw = probe_hardware(tmp_path)
    assert hw.cpu.arch == "unknown" and hw.cpu.online_cpus == 0 and hw.cpu.isa == ()
    assert hw.jetson is None and hw.nvidia_dgpu is None and hw.neuron is None
    assert hw.intel.gpus == () and hw.thermal == () and hw.cgroup.version == 0
    assert hw.budget.effective_cpus == 1 and hw.budget.memory_bytes is None


def test_missing_root_does_not_crash(tmp_path: Path) -> None:
    hw = probe_hardware(tmp_path / "does-not-exist")
    assert hw.cpu.arch == "unknown"


def test_corrupted_files(tmp_path: Path) -> None:
    root = copy_fixture("jetson-orin", tmp_path)
    (root / "etc/nv_tegra_release").write_bytes(b"\xff\xfe garbage \x00\x01")
    (root / "proc/device-tree/compatible").write_bytes(os.urandom(64).replace(b"nvidia", b"xxxxxx"))
    (root / "proc/cpuinfo").write_bytes(b"\x00\xff" * 100)
    (root / "proc/meminfo").write_text("MemTotal: lots kB\nMemAvailable:\n")
    (root / "sys/class/thermal/thermal_zone0/temp").write_text("hot\n")
    (root / "sys/class/thermal/thermal_zone1/temp").write_text("999999999\n")
    (root / "sys/devices/system/cpu/online").write_text("7-0,x\n")
    cg = root / "sys/fs/cgroup/system.slice/edgeserve.service"
    (cg / "cpu.max").write_text("lots 100000\n")
    (cg / "memory.max").write_text("-5\n")
    hw = probe_hardware(root)
    assert hw.cpu.arch == "unknown" and hw.cpu.online_cpus == 0
    assert hw.memory.total_bytes is None
    assert hw.thermal[0].temp_c is None and hw.thermal[1].temp_c is None
    assert hw.cgroup.cpu_quota is None and hw.cgroup.memory_limit is None
    # the devfreq node still says "Jetson"; the rest degrades to unknown
    assert hw.jetson is not None and hw.jetson.l4t is None and hw.jetson.soc is None


def test_unreadable_and_wrong_type_files(tmp_path: Path) -> None:
    root = copy_fixture("x86-nvidia-dgpu", tmp_path)
    info = root / "proc/driver/nvidia/gpus/0000:01:00.0/information"
    info.unlink()
    info.mkdir()  # a directory where a file should be: reads fail with IsADirectoryError
    (root / "proc/driver/nvidia/version").unlink()
    (root / "proc/driver/nvidia/version").symlink_to(root / "nowhere")  # dangling link
    (root / "proc/cpuinfo").unlink()
    (root / "proc/cpuinfo").mkdir()
    hw = probe_hardware(root)
    assert hw.nvidia_dgpu is not None  # /dev/nvidia0 is still there
    assert (
        hw.nvidia_dgpu.gpus == () and hw.nvidia_dgpu.driver == "550.54.14"
    )  # from /sys/module/nvidia/version
    assert hw.cpu.arch == "unknown"


def test_helpers() -> None:
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("") is None and parse_cpu_list("a-b") is None and parse_cpu_list("3-1") is None
    assert l4t_from_release("# R35 (release), REVISION: 4.1, GCID: 1") == "35.4.1"
    assert l4t_from_release("nonsense") is None
    assert jetpack_for("36.4.4") == ("6.2.1", "10.3", "12.6")
    assert jetpack_for("99.1") == (None, None, None)
    assert FsRoot("/").is_live and not FsRoot(FIXTURES).is_live


def test_live_root_probes_this_machine() -> None:
    hw = probe_hardware("/")
    assert hw.cpu.arch in ("x86_64", "aarch64") and hw.budget.effective_cpus >= 1
