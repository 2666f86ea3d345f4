"""The small memory profile in the runtime plan: OpenVINO on the CPU is left out for a model with dynamic
dims while ONNX Runtime can run it (OpenVINO keeps kernels and buffers per input shape), but a model
only OpenVINO can run (an IR, model.xml) still loads: the profile trades speed for memory, never a
model that loaded before the upgrade."""

from __future__ import annotations

from pathlib import Path

from hw_helpers import PROFILES, copy_fixture, settings
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.hardware.plan import Planner
from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.profile import load_profiles, match_profile
from edgeserve.hardware.runtimes import inventory

RUNTIMES = inventory({"onnxruntime": "1.20.0", "openvino": "2024.4.0"})


def _planner(tmp: Path, profile: str) -> Planner:
    hw = probe_hardware(copy_fixture("x86-cpu", tmp / "root"))
    device = match_profile(hw, load_profiles(builtin=[PROFILES]))
    return Planner(hw, device, RUNTIMES, settings(tmp, memory_profile=profile))


def _dynamic() -> mc.ModelConfig:
    config = mc.ModelConfig(name="m", max_batch_size=0)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1, 3, -1, -1])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[1, -1])
    return config


def _version(tmp: Path, *files: str) -> Path:
    folder = tmp / "repo" / "m" / "1"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"\0" * (1 << 20))  # over the profile's size floors
    return folder


def test_small_prefers_onnxruntime_for_dynamic_shapes(tmp_path: Path) -> None:
    version = _version(tmp_path, "model.onnx")
    small = _planner(tmp_path, "small").plan_model("m", version, _dynamic())
    assert small.chosen is not None and small.chosen.option.backend == "onnxruntime"
    refused = [v.reason for v in small.verdicts if v.option.backend == "openvino"]
    assert refused and all("memory profile small" in reason for reason in refused)
    standard = _planner(tmp_path / "s", "standard").plan_model("m", version, _dynamic())
    assert standard.chosen is not None and standard.chosen.option.backend == "openvino"


def test_small_still_loads_what_only_openvino_runs(tmp_path: Path) -> None:
    version = _version(tmp_path, "model.xml", "model.bin")
    plan = _planner(tmp_path, "small").plan_model("m", version, _dynamic())
    assert plan.chosen is not None, plan
    assert plan.chosen.option.backend == "openvino" and plan.chosen.option.device.startswith("CPU")
    assert "memory profile small" in plan.chosen.reason and "no other runtime" in plan.chosen.reason
