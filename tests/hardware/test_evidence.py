"""Profiles know their CPU: the measurements a profile records, each with the CPU it came from, order its
CPU candidates on a CPU of that vendor and ISA tier, and the plan says which evidence its choice rests on
(or that none applies here). Probed from the fixture trees; no runtime is run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hw_helpers import FIXTURES, PROFILES, ROOT, make_repository, settings

from edgeserve.hardware.evidence import cpu_class, rule_for
from edgeserve.hardware.plan import Planner
from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.profile import ProfileError, load_profile, load_profiles, parse_profile
from edgeserve.hardware.runtimes import detect_runtimes

ALL_BACKENDS = ("onnxruntime", "openvino", "tensorrt", "neuron", "python")

# OpenVINO listed first (with a claim of its own), ONNX Runtime measured faster on AMD AVX2 and slower
# on Intel AMX; an accelerator first, which measurements of CPU runtimes must leave in its place.
PROFILE = """
name = "x86-measured"
priority = 10
[match]
arch = ["x86_64"]

[[candidates]]
backend = "openvino"
device = "GPU"
precisions = ["fp16"]

[[candidates]]
backend = "openvino"
device = "CPU"
precisions = ["fp32"]
note = "OpenVINO beat ONNX Runtime somewhere once"

[[candidates]]
backend = "onnxruntime"
device = "CPU"
precisions = ["fp32"]

[[measurements]]
cpu = "AMD EPYC 7R13, 2 vCPUs"
vendor = "amd"
isa = "avx2"
model = "resnet50 [1,224,224,3]"
ms = { onnxruntime = 30.0, openvino = 45.0 }
source = "a test"

[[measurements]]
cpu = "Intel Xeon Gold 6430"
vendor = "intel"
isa = "amx"
model = "ppocr_det [1,3,640,640]"
ms = { onnxruntime = 50.0, openvino = 20.0 }
"""


def _planner(fixture: str, tmp: Path, profile_text: str = PROFILE) -> Planner:
    root = FIXTURES / fixture
    tree = detect_runtimes(root)
    runtimes = type(tree)(tree.runtimes, frozenset(ALL_BACKENDS), tree.source)  # every backend present
    (tmp / "profiles").mkdir(exist_ok=True)
    path = tmp / "profiles" / "measured.toml"
    path.write_text(profile_text)
    return Planner(probe_hardware(root), load_profile(path), runtimes, settings(tmp))


def test_cpu_class_of_each_fixture() -> None:
    classes = {name: str(cpu_class(probe_hardware(FIXTURES / name).cpu)) for name in
               ("x86-cpu", "x86-intel-gpu-npu", "aws-inferentia", "arm-rk3588", "jetson-orin")}  # fmt: skip
    assert classes == {
        "x86-cpu": "intel amx",  # Xeon Gold 6430 (Sapphire Rapids)
        "x86-intel-gpu-npu": "intel avx2",  # Core Ultra 7 155H: AVX-VNNI, no AVX-512
        "aws-inferentia": "amd avx2",  # EPYC 7R13
        "arm-rk3588": "arm dotprod",
        "jetson-orin": "arm dotprod",
    }


def test_measurements_of_this_cpu_order_the_rule_and_the_plan_names_them(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    planner = _planner("aws-inferentia", tmp_path)  # AMD EPYC 7R13: AVX2
    plan = planner.plan_model("big", repo / "big" / "1", None)
    assert plan.chosen is not None and plan.chosen.option.backend == "onnxruntime"
    reason = plan.chosen.reason
    assert "measured on amd avx2 CPUs" in reason and "onnxruntime 1.00x, openvino 1.50x" in reason
    rule = planner.rule
    assert [f"{c.backend} {c.device}" for c in rule.candidates] == [
        "openvino GPU", "onnxruntime CPU", "openvino CPU",
    ]  # the accelerator keeps its slot  # fmt: skip
    assert "resnet50 [1,224,224,3]: onnxruntime 30 ms, openvino 45 ms" in rule.basis
    assert "AMD EPYC 7R13, 2 vCPUs" in rule.basis and "Intel" not in rule.basis  # only this CPU's
    # the plan weighs the options in the rule's order (this fixture has no openvino: it says so)
    labels = [v.option.label() for v in plan.verdicts]
    assert labels.index("onnxruntime CPU fp32 [CPU]") < labels.index("openvino CPU fp32")


def test_the_same_profile_on_another_vendor_and_isa_follows_its_own_measurements(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    plan = _planner("x86-cpu", tmp_path).plan_model("big", repo / "big" / "1", None)  # Intel AMX
    assert plan.chosen is not None and plan.chosen.option.backend == "openvino"
    assert "measured on intel amx CPUs: openvino 1.00x, onnxruntime 2.50x" in plan.chosen.reason


def test_another_vendors_measurements_of_the_same_tier_are_used_and_said_so(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    planner = _planner("x86-intel-gpu-npu", tmp_path)  # Intel AVX2: only AMD's AVX2 figures apply
    assert "measured on other vendors' avx2 CPUs" in planner.rule.basis
    plan = planner.plan_model("big", repo / "big" / "1", None)
    assert plan.chosen is not None and plan.chosen.option.label() == "openvino GPU fp16"  # the iGPU
    assert [v.option.label() for v in plan.fallbacks] == ["onnxruntime CPU fp32 [CPU]", "openvino CPU fp32"]


def test_no_measurement_for_this_cpu_keeps_the_profile_order_and_says_it_is_unmeasured(
    tmp_path: Path,
) -> None:
    repo = make_repository(tmp_path)
    text = PROFILE.replace('isa = "amx"', 'isa = "avx512_vnni"')  # now nothing for Intel AMX
    planner = _planner("x86-cpu", tmp_path, text)
    basis = planner.rule.basis
    assert basis.startswith("the profile's order, unmeasured on intel amx CPUs")
    assert "it has some for amd avx2, intel avx512_vnni CPUs" in basis
    plan = planner.plan_model("big", repo / "big" / "1", None)
    assert plan.chosen is not None and plan.chosen.option.backend == "openvino"
    assert plan.chosen.reason == (
        "OpenVINO beat ONNX Runtime somewhere once; the profile's order, unmeasured on intel amx CPUs"
    )


def test_shipped_profiles_record_the_cpu_of_every_measurement() -> None:
    profiles = {p.name: p for p in load_profiles(builtin=[PROFILES])}
    x86 = profiles["x86-cpu"]
    assert x86.measurements, "x86-cpu orders its CPU candidates from measurements"
    for m in x86.measurements:
        assert m.cpu and m.vendor and m.isa and m.model and m.source and len(m.ms) >= 2
    on_amd = rule_for(
        x86.name, x86.candidates, x86.measurements, probe_hardware(FIXTURES / "aws-inferentia").cpu
    )
    assert on_amd.basis.startswith("measured on amd avx2 CPUs") and "open_nsfw" in on_amd.basis
    on_intel = rule_for(x86.name, x86.candidates, x86.measurements, probe_hardware(FIXTURES / "x86-cpu").cpu)
    assert on_intel.basis.startswith("the profile's order, unmeasured on intel amx CPUs")
    arm = profiles["arm-cpu"]
    on_arm = rule_for(arm.name, arm.candidates, arm.measurements, probe_hardware(FIXTURES / "arm-rk3588").cpu)
    assert on_arm.basis == (
        "the profile's order, unmeasured on arm dotprod CPUs: arm-cpu has no measurements for them"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('cpu = "AMD EPYC 7R13, 2 vCPUs"\n', ""), "measurements[0].cpu: required"),
        (('isa = "avx2"', 'isa = "avx3"'), "measurements[0].isa: 'avx3' is not one of"),
        (("ms = { onnxruntime = 30.0, openvino = 45.0 }", "ms = { onnxruntime = 30.0 }"), "two or more"),
        (("openvino = 45.0 }", "openvino = 0 }"), "measurements[0].ms.openvino: expected a positive"),
        (('source = "a test"', 'sorce = "a test"'), "unknown key(s) ['sorce']"),
    ],
)
def test_a_measurement_without_its_cpu_or_figures_is_refused(
    edit: tuple[str, str], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "broken.toml"
    assert edit[0] in PROFILE
    path.write_text(PROFILE.replace(edit[0], edit[1], 1))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value) and message in str(info.value)
    # a broken user profile is skipped (logged), never fatal: the shipped ones still load
    names = {p.name for p in load_profiles([tmp_path], builtin=[PROFILES])}
    assert "x86-measured" not in names and "x86-cpu" in names


def test_detect_shows_the_rule_and_its_evidence(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "measured.toml").write_text(PROFILE)
    repo = make_repository(tmp_path)
    env = {**os.environ, "EDGESERVE_RUNTIME_DEVICE_PROFILES": str(tmp_path / "profiles")}
    base = [sys.executable, "-m", "edgeserve", "detect", "--root", str(FIXTURES / "x86-cpu"),
            "--model-repository", str(repo)]  # fmt: skip
    text = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert text.returncode == 0, text.stderr
    assert "profile:  x86-measured" in text.stdout
    assert "rule:     measured on intel amx CPUs: openvino 1.00x, onnxruntime 2.50x" in text.stdout
    evidence = "ppocr_det [1,3,640,640]: openvino 20 ms, onnxruntime 50 ms; on Intel Xeon Gold 6430"
    assert evidence in text.stdout
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    rule = json.loads(out.stdout)["profile"]["rule"]
    assert rule["cpu"] == {"vendor": "intel", "isa": "amx"}
    assert rule["order"] == ["openvino GPU", "openvino CPU", "onnxruntime CPU"]
    assert rule["scores"] == {"openvino": 1.0, "onnxruntime": 2.5}
    assert [e["cpu"] for e in rule["evidence"]] == ["Intel Xeon Gold 6430"]


def test_parse_profile_without_measurements_is_unchanged() -> None:
    profile = parse_profile({"candidates": [{"backend": "onnxruntime"}]}, "inline.toml")
    assert profile.measurements == () and "measurements" not in profile.extra
