"""Every captured profile gives the expected plan; pins, user profiles, the guard's place in the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from hw_helpers import FIXTURES, PROFILES, make_repository, settings
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.hardware.plan import GuardResult, PlanOption
from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.profile import ProfileError, load_profile, load_profiles, match_profile
from edgeserve.hardware.runtimes import detect_runtimes, inventory
from edgeserve.hardware.selector import PlanSelector
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_pbtxt, parse_text

ALL_BACKENDS = ("onnxruntime", "openvino", "tensorrt", "neuron", "python")

Choice = tuple[str, str, str] | None  # (backend, device, precision); None: nothing can run it
ORT_CPU = ("onnxruntime", "CPU", "fp32")
TRT_FP16 = ("tensorrt", "GPU", "fp16")
ORT_FP16 = ("onnxruntime", "GPU", "fp16")


def models(
    big: Choice, tiny: Choice = ORT_CPU, engine: Choice = ORT_CPU, torch: Choice = None
) -> dict[str, Choice]:
    """The expected choice for each model of hw_helpers.make_repository."""
    return {"big": big, "tiny": tiny, "engine": engine, "torch": torch}


# fixture -> (profile, {model: choice})
EXPECTED = {
    "jetson-orin": ("jetson-orin", models(TRT_FP16, TRT_FP16, ("tensorrt", "GPU", "auto"))),
    "jetson-xavier-nano": ("jetson-xavier-nano", models(ORT_FP16, ORT_FP16, ORT_FP16)),
    "x86-cpu": ("x86-cpu", models(("openvino", "CPU", "bf16"))),
    "x86-intel-gpu-npu": ("x86-intel-gpu-npu", models(("openvino", "GPU", "fp16"))),
    "x86-nvidia-dgpu": ("x86-nvidia-dgpu", models(TRT_FP16, TRT_FP16, ("tensorrt", "GPU", "auto"))),
    "arm-cpu": ("arm-cpu", models(("openvino", "CPU", "fp16"))),
    "arm-rk3588": ("arm-cpu", models(ORT_CPU)),
    "aws-inferentia": ("aws-inferentia", models(ORT_CPU, torch=("neuron", "NEURON", "auto"))),
}


def selector_for(fixture: str, tmp: Path, **kwargs: object) -> PlanSelector:
    root = FIXTURES / fixture
    tree = detect_runtimes(root)
    runtimes = type(tree)(
        tree.runtimes, frozenset(ALL_BACKENDS), tree.source
    )  # every edgeserve backend present
    s = settings(tmp)
    s.runtime.hardware_root = root
    return PlanSelector(s, runtimes=runtimes, profiles=load_profiles(builtin=[PROFILES]), **kwargs)  # type: ignore[arg-type]


def test_every_fixture_has_an_expectation() -> None:
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(EXPECTED)


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_plan(fixture: str, tmp_path: Path) -> None:
    profile, models = EXPECTED[fixture]
    selector = selector_for(fixture, tmp_path)
    assert selector.profile.name == profile
    repo = make_repository(tmp_path)
    for name, expected in models.items():
        config_path = repo / name / "config.pbtxt"
        config = parse_pbtxt(config_path) if config_path.exists() else mc.ModelConfig()
        plan = selector.plan(name, repo / name / "1", config)
        got = (
            None
            if plan.chosen is None
            else (plan.chosen.option.backend, plan.chosen.option.device, plan.chosen.option.precision)
        )
        assert got == expected, f"{fixture}/{name}: {plan.to_dict()}"
        for verdict in plan.rejected:
            assert verdict.reason, verdict  # every rejected option says why
        if expected is None:
            with pytest.raises(InferenceError) as info:
                selector.choose(name, repo / name, repo / name / "1", config)
            assert info.value.status == Status.UNAVAILABLE
        else:
            choice = selector.choose(name, repo / name, repo / name / "1", config)
            assert (choice.backend_name, choice.options.device, choice.options.precision) == expected
            assert choice.model_path.parent == repo / name / "1"
            assert choice.options.threads >= 1 and profile in choice.reason


def test_rejection_reasons(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    nano = selector_for("jetson-xavier-nano", tmp_path).plan("big", repo / "big" / "1", None)
    reasons = {v.option.label(): v.reason for v in nano.rejected}
    assert "TensorRT 8.2.1.8 is older than 10.0" in reasons["tensorrt GPU fp16"]
    cpu = selector_for("x86-cpu", tmp_path).plan("tiny", repo / "tiny" / "1", None)
    assert "under the profile's 64 KiB floor for openvino" in cpu.rejected[0].reason
    npu = selector_for("x86-intel-gpu-npu", tmp_path)
    reasons = {v.option.label(): v.reason for v in npu.plan("tiny", repo / "tiny" / "1", None).rejected}
    assert "no native bf16" in reasons["openvino CPU bf16"]
    inf = selector_for("aws-inferentia", tmp_path).plan("big", repo / "big" / "1", None)
    reasons = {v.option.label(): v.reason for v in inf.rejected}
    assert reasons["neuron NEURON auto"] == "no model.pt in 1/"
    assert "'openvino' not installed" in reasons["openvino CPU bf16"]


def test_pins(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    selector = selector_for("x86-cpu", tmp_path)
    pinned = parse_text('backend: "onnxruntime"', "t")
    choice = selector.choose("big", repo / "big", repo / "big" / "1", pinned)
    assert choice.backend_name == "onnxruntime" and choice.fallbacks == ()
    assert "pinned by config backend 'onnxruntime'" in choice.reason
    fp32 = parse_text('parameters { key: "precision" value: { string_value: "fp32" } }', "t")
    assert selector.choose("big", repo / "big", repo / "big" / "1", fp32).options.precision == "fp32"
    npu = selector_for("x86-intel-gpu-npu", tmp_path)
    dev = parse_text('parameters { key: "device" value: { string_value: "NPU" } }', "t")
    choice = npu.choose("big", repo / "big", repo / "big" / "1", dev)
    assert (choice.backend_name, choice.options.device, choice.options.precision) == (
        "openvino",
        "NPU",
        "fp16",
    )
    dynamic = parse_text(
        'parameters { key: "device" value: { string_value: "NPU" } }\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, 256 ] } ]',
        "t",
    )
    with pytest.raises(InferenceError, match="no option can run it"):
        npu.choose("big", repo / "big", repo / "big" / "1", dynamic)
    gpu_group = parse_text("instance_group [ { kind: KIND_GPU } ]", "t")
    with pytest.raises(InferenceError, match="not the pinned device GPU"):
        selector.choose("big", repo / "big", repo / "big" / "1", gpu_group)


def test_pinned_backend_unavailable_is_a_clear_error(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    selector = selector_for("x86-cpu", tmp_path)
    pinned = parse_text('platform: "tensorrt_plan"', "t")
    with pytest.raises(InferenceError) as info:
        selector.choose("engine", repo / "engine", repo / "engine" / "1", pinned)
    assert info.value.status == Status.UNAVAILABLE
    assert "backend 'tensorrt' is pinned (config platform 'tensorrt_plan')" in info.value.message
    assert "no NVIDIA GPU here" in info.value.message
    with pytest.raises(InferenceError) as info:
        selector.choose("big", repo / "big", repo / "big" / "1", parse_text('backend: "nonsense"', "t"))
    assert info.value.status == Status.INVALID_ARG and "nonsense" in info.value.message


def test_dla_pin_respects_dla_count(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    orin = selector_for("jetson-orin", tmp_path)
    dla1 = parse_text(
        'parameters [ { key: "device" value: { string_value: "DLA:1" } },'
        '{ key: "precision" value: { string_value: "fp16" } } ]',
        "t",
    )
    choice = orin.choose("big", repo / "big", repo / "big" / "1", dla1)
    assert (choice.backend_name, choice.options.device) == ("tensorrt", "DLA:1")
    dla2 = parse_text('parameters { key: "device" value: { string_value: "DLA:2" } }', "t")
    with pytest.raises(InferenceError, match="2 DLA core"):
        orin.choose("big", repo / "big", repo / "big" / "1", dla2)


def test_guard_decides_lower_precision(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    calls: list[PlanOption] = []

    def strict(path: Path, option: PlanOption, tolerance: float) -> GuardResult:
        calls.append(option)
        return GuardResult(False, f"max relative error 5.0e-02 > tolerance {tolerance:g}", 0.05)

    selector = selector_for("x86-cpu", tmp_path, guard=strict)
    plan = selector.plan("big", repo / "big" / "1", None)
    assert plan.chosen is not None and plan.chosen.option.label() == "openvino CPU fp32"
    assert plan.rejected[0].reason.startswith("accuracy guard: max relative error 5.0e-02")
    assert [c.precision for c in calls] == ["bf16"]
    allowed = parse_text('parameters { key: "precision" value: { string_value: "bf16" } }', "t")
    plan = selector.plan("big", repo / "big" / "1", allowed)
    assert plan.chosen is not None and plan.chosen.option.precision == "bf16"
    assert plan.chosen.reason.startswith("allowed by config") and len(calls) == 1  # config vouches: no guard
    tolerance = parse_text('parameters { key: "accuracy_tolerance" value: { string_value: "0.1" } }', "t")
    selector.plan("big", repo / "big" / "1", tolerance)
    assert len(calls) == 2


def test_user_profile_folder_overrides_and_adds(tmp_path: Path) -> None:
    user = tmp_path / "profiles"
    user.mkdir()
    (user / "x86-cpu.toml").write_text(
        'name = "x86-cpu"\ndescription = "mine"\n[match]\narch = ["x86_64"]\n'
        '[[candidates]]\nbackend = "onnxruntime"\n'
    )
    (user / "rpi5.toml").write_text(
        'name = "rpi5-hailo"\n[match]\narch = ["aarch64"]\nboard_family = ["raspberrypi"]\n'
        '[runtime]\nthreads = 2\n[[candidates]]\nbackend = "onnxruntime"\n'
    )
    (user / "broken.toml").write_text("this is [not toml")
    profiles = load_profiles([user], builtin=[PROFILES])
    names = {p.name: p for p in profiles}
    assert names["x86-cpu"].description == "mine" and "broken" not in names
    rpi = match_profile(probe_hardware(FIXTURES / "arm-cpu"), profiles)
    assert rpi.name == "rpi5-hailo" and rpi.threads == 2
    assert match_profile(probe_hardware(FIXTURES / "arm-rk3588"), profiles).name == "arm-cpu"


def test_profile_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[match]\nwhatever = 1\n[[candidates]]\nbackend = "onnxruntime"\n')
    with pytest.raises(ProfileError, match="unknown condition"):
        load_profile(bad)
    bad.write_text('[[candidates]]\nbackend = "coreml"\n')
    with pytest.raises(ProfileError, match=r"candidates\[0\]\.backend"):
        load_profile(bad)
    bad.write_text('[[candidates]]\nbackend = "openvino"\nprecisions = ["fp8"]\n')
    with pytest.raises(ProfileError, match="precisions"):
        load_profile(bad)


def test_no_profiles_found_uses_fallback(tmp_path: Path) -> None:
    profiles = load_profiles(builtin=[tmp_path / "none"])
    assert [p.name for p in profiles] == ["generic-cpu"]


def test_live_selector_on_this_machine(tmp_path: Path) -> None:
    """The real probe, the real runtimes and the real guard, end to end, on the tiny model."""
    repo = make_repository(tmp_path)
    s = settings(tmp_path)
    selector = PlanSelector(s, runtimes=inventory({"onnxruntime": "x", "openvino": "y"}))
    choice = selector.choose("tiny", repo / "tiny", repo / "tiny" / "1", mc.ModelConfig())
    assert choice.backend_name == "onnxruntime"  # small model: onnxruntime wins everywhere
