"""The runtime plan: for each model, the backend, device, precision and threads, with the reason for
every option that lost.

Options come from the device profile's `[[candidates]]` in the order its measurements give this CPU
(evidence.py; a pinned backend that the profile does not list is added first). Each option must pass,
in order: the config's pins, an importable runtime, the device on this box, an artifact in the version
folder, the precision rules (settings, CPU/GPU support, config), the model-size and memory checks,
and, for a lower precision the config does not vouch for, the accuracy guard. The first that passes
is chosen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from edgeserve.backends import memory
from edgeserve.backends.options import PINNED_PARAMETER, BackendOptions
from edgeserve.config import Settings
from edgeserve.hardware.evidence import rule_for
from edgeserve.hardware.pins import ARTIFACTS, Pins, artifact_bytes, find_artifact, parameters, read_pins
from edgeserve.hardware.plan_types import AccuracyGuard as AccuracyGuard
from edgeserve.hardware.plan_types import GuardResult as GuardResult
from edgeserve.hardware.plan_types import ModelPlan as ModelPlan
from edgeserve.hardware.plan_types import PlanOption as PlanOption
from edgeserve.hardware.plan_types import Verdict as Verdict
from edgeserve.hardware.probes import HardwareInfo
from edgeserve.hardware.profile import Candidate, DeviceProfile
from edgeserve.hardware.runtimes import RuntimeInventory

CPU_EP = "CPUExecutionProvider"
GPU_EPS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
MIN_TENSORRT = (10, 0)  # the name-based I/O API the tensorrt backend uses


def _version_tuple(version: str | None) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in (version or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


class Planner:
    """Plans models for one box: hardware + profile + runtimes + settings (+ an optional accuracy guard)."""

    def __init__(
        self,
        hw: HardwareInfo,
        profile: DeviceProfile,
        runtimes: RuntimeInventory,
        settings: Settings,
        guard: AccuracyGuard | None = None,
    ) -> None:
        self.hw = hw
        self.profile = profile
        self.runtimes = runtimes
        self.settings = settings
        self.guard = guard
        # the candidates in this CPU's order, with what that order rests on
        self.rule = rule_for(profile.name, profile.candidates, profile.measurements, hw.cpu)

    # -- box-wide --------------------------------------------------------------------------------
    def threads(self, instances: int = 1) -> tuple[int, str]:
        if self.settings.runtime.cpu_threads > 0:
            total, why = self.settings.runtime.cpu_threads, "settings runtime.cpu_threads"
        elif self.profile.threads > 0:
            total = min(self.profile.threads, self.hw.budget.effective_cpus)
            why = f"profile {self.profile.name} threads (capped by {self.hw.budget.cpu_reason})"
        else:
            total = max(1, self.hw.budget.effective_cpus - self.profile.reserve_cores)
            why = self.hw.budget.cpu_reason
            if self.profile.reserve_cores:
                why += f", {self.profile.reserve_cores} reserved by profile {self.profile.name}"
        if instances > 1:
            return max(1, total // instances), f"{why}, shared by {instances} instances"
        return max(1, total), why

    def memory_profile(self) -> memory.MemoryProfile:
        """The runtime memory profile for this box (backends/memory.py): as the server resolves it."""
        budget = self.hw.budget
        return memory.resolve(self.settings.runtime.memory_profile, budget.memory_bytes, budget.memory_reason)

    def memory_budget(self) -> int | None:
        total = self.hw.budget.memory_bytes
        if total is None:
            return None
        return max(0, total - self.profile.memory_headroom_mb * 2**20)

    # -- per option ------------------------------------------------------------------------------
    def _options(self, pins: Pins) -> list[tuple[PlanOption, Candidate]]:
        candidates = list(self.rule.candidates)
        if pins.backend and all(c.backend != pins.backend for c in candidates):
            device = pins.device or (
                "GPU" if pins.backend == "tensorrt" else "NEURON" if pins.backend == "neuron" else "CPU"
            )
            precisions = ("auto",) if pins.backend == "neuron" else ("fp32",)
            candidates.insert(0, Candidate(pins.backend, device, precisions, note="pinned by the config"))
        if pins.device and not any(
            c.device == pins.device or c.device == pins.device.split(":")[0]
            for c in candidates
            if not pins.backend or c.backend == pins.backend
        ):
            backend = pins.backend or ("tensorrt" if pins.device.startswith("DLA") else "openvino")
            candidates.insert(
                0, Candidate(backend, pins.device, ("fp16", "fp32"), note="pinned by the config")
            )
        options: list[tuple[PlanOption, Candidate]] = []
        for cand in candidates:
            device = cand.device
            if pins.device and (device == pins.device.split(":")[0] or device == pins.device):
                device = pins.device  # keep the pinned index (GPU:1, DLA:1)
            providers = self._providers(cand) if cand.backend == "onnxruntime" else ()
            for precision in cand.precisions:
                options.append((PlanOption(cand.backend, device, precision, providers), cand))
        return options

    def _providers(self, cand: Candidate) -> tuple[str, ...]:
        wanted = list(cand.providers) or ([CPU_EP] if cand.device == "CPU" else [*GPU_EPS, CPU_EP])
        if cand.device == "CPU":  # CPU-side EPs (OpenVINO EP ...) only where the installed wheel has them
            available = self.runtimes.ort_providers()
            wanted = [p for p in wanted if p in available or p == CPU_EP]
        if CPU_EP not in wanted:
            wanted.append(CPU_EP)
        return tuple(wanted)

    def _device_reason(self, option: PlanOption) -> str | None:
        hw, base = self.hw, option.device.split(":")[0]
        if base == "CPU":
            return None
        if option.backend == "openvino":
            if base == "GPU" and not hw.intel.gpus:
                return "no Intel GPU here (no /dev/dri render node with an i915/xe driver)"
            if base == "NPU" and not hw.intel.npus:
                return "no Intel NPU here (no /dev/accel node with the intel_vpu driver)"
            if base not in ("GPU", "NPU", "AUTO", "HETERO", "MULTI"):
                return f"openvino has no device {option.device}"
            return None
        if option.backend in ("tensorrt", "onnxruntime") and base in ("GPU", "DLA"):
            if hw.jetson is None and hw.nvidia_dgpu is None:
                return "no NVIDIA GPU here (no Jetson iGPU, no /proc/driver/nvidia GPUs or /dev/nvidiaN)"
            if base == "DLA":
                if option.backend != "tensorrt":
                    return "DLA is reached through the tensorrt backend"
                cores = hw.jetson.dla_cores if hw.jetson else 0
                index = int(option.device.partition(":")[2] or 0)
                if cores is not None and index >= cores:
                    return f"this module has {cores} DLA core(s); {option.device} does not exist"
            if option.backend == "onnxruntime" and self.runtimes.status("onnxruntime").available:
                available = self.runtimes.ort_providers()
                missing = [p for p in option.providers if p != CPU_EP and p not in available]
                if missing and not any(p in available for p in GPU_EPS):
                    dist = self.runtimes.status("onnxruntime").distribution or "onnxruntime"
                    return (
                        f"the installed {dist} wheel has no {', '.join(_short(m) for m in missing)} "
                        "execution provider (install onnxruntime-gpu)"
                    )
            return None
        if base == "NEURON":
            if option.backend != "neuron":
                return (
                    f"{option.backend} cannot run on AWS Neuron devices (no ONNX/OpenVINO path to Inferentia)"
                )
            return None if hw.neuron else "no AWS Neuron devices here (/dev/neuronN)"
        return f"{option.backend} does not run on {option.device}"

    def _runtime_reason(self, option: PlanOption) -> str | None:
        if option.backend == "tensorrt":
            version = self.runtimes.status("tensorrt").version
            if (
                self.runtimes.status("tensorrt").available
                and version
                and _version_tuple(version) < MIN_TENSORRT
            ):
                return (
                    f"TensorRT {version} is older than 10.0; edgeserve's tensorrt backend uses TensorRT 10's "
                    "name-based I/O API"
                )
        return self.runtimes.backend_unavailable(option.backend)

    def _precision_reason(self, option: PlanOption, pins: Pins) -> str | None:
        precision, base = option.precision, option.device.split(":")[0]
        if precision == "auto":
            return None
        if pins.precision and precision != pins.precision:
            return f"config parameters.precision is {pins.precision}"
        if precision == "fp32":
            return None
        if precision not in self.settings.runtime.allowed_precisions and precision not in pins.allowed:
            return f"{precision} is not in settings runtime.allowed_precisions"
        if precision == "int8" and "int8" not in pins.allowed:
            return "int8 needs a quantized/calibrated model: allow it with parameters.precision int8"
        if base == "CPU":
            cpu = self.hw.cpu
            if precision == "bf16" and not cpu.bf16:
                return "this CPU has no native bf16 (needs AVX512_BF16 or AMX; ARM bf16)"
            if precision == "fp16" and not cpu.fp16:
                return "this CPU has no native fp16 arithmetic (ARMv8.2 FP16, AVX512-FP16 or AMX-FP16)"
        if base in ("GPU", "DLA") and option.backend in ("tensorrt", "onnxruntime") and precision == "bf16":
            cc = self.hw.jetson.compute_capability if self.hw.jetson else None
            if cc is None and self.hw.nvidia_dgpu and self.hw.nvidia_dgpu.gpus:
                cc = self.hw.nvidia_dgpu.gpus[0].compute_capability
            if cc is not None and _version_tuple(cc) < (8, 0):
                return f"bf16 needs compute capability 8.0+ (this GPU is sm {cc})"
        return None

    def _size_reason(self, option: PlanOption, cand: Candidate, size: int, pinned: bool) -> str | None:
        if cand.min_model_bytes and size < cand.min_model_bytes and not pinned:
            return (
                f"model is {size / 1024:.1f} KiB, under the profile's {cand.min_model_bytes // 1024} KiB "
                f"floor for {option.backend}: its fixed per-call cost would outweigh the gain"
            )
        budget = self.memory_budget()
        need = int(size * self.profile.memory_factor)
        if budget is not None and size and need > budget:
            return (
                f"needs about {need / 2**20:.0f} MiB ({self.profile.memory_factor:g} x "
                f"{size / 2**20:.0f} MiB file), {budget / 2**20:.0f} MiB left after "
                f"{self.profile.memory_headroom_mb} MiB headroom "
                f"({self.hw.budget.memory_reason})"
            )
        return None

    def _static(
        self, option: PlanOption, cand: Candidate, pins: Pins, version_dir: Path, config: Any, lean: bool
    ) -> tuple[str | None, Path | None, str]:
        """(reason it cannot run, artifact, note) without running anything (`lean`: memory preference too)."""
        if pins.backend and option.backend != pins.backend:
            return f"not the pinned backend ({pins.backend_why})", None, ""
        if pins.device and option.device != pins.device:
            return f"not the pinned device {pins.device} ({pins.device_why})", None, ""
        reason = self._device_reason(option) or self._runtime_reason(option)
        if reason:
            return reason, None, ""
        artifact = find_artifact(option.backend, version_dir, pins.filename)
        if artifact is None:
            wanted = pins.filename or " or ".join(ARTIFACTS.get(option.backend, ()))
            return f"no {wanted} in {version_dir.name}/", None, ""
        reason = self._precision_reason(option, pins) or self._size_reason(
            option, cand, artifact_bytes(artifact), pinned=pins.backend == option.backend
        )
        if reason:
            return reason, artifact, ""
        if option.device.split(":")[0] == "NPU" and _dynamic_dims(config):
            return "the NPU needs static shapes; the config declares dynamic dims", artifact, ""
        if lean and pins.backend != option.backend:
            dynamic = _dynamic_dims(config)
            reason = memory.plan_refusal(self.memory_profile(), option.backend, option.device, dynamic)
            if reason:
                return reason, artifact, ""
        note = cand.note
        if option.backend == "tensorrt" and artifact.suffix == ".onnx":
            note = "no model.plan: the engine is built from model.onnx on first load and cached"
        return None, artifact, note

    # -- per model -------------------------------------------------------------------------------
    def plan_model(self, name: str, version_dir: Path, config: Any, where: str | None = None) -> ModelPlan:
        plan = self._plan_model(name, version_dir, config, where, lean=True)
        if plan.chosen is None and any(v.reason.startswith(memory.REFUSAL) for v in plan.verdicts):
            # The memory profile orders runtimes; it never keeps out a model no other runtime can run.
            plan = self._plan_model(name, version_dir, config, where, lean=False)
            if plan.chosen is not None:
                note = f"{memory.REFUSAL}{self.memory_profile().name}: no other runtime runs it"
                chosen = dataclasses.replace(plan.chosen, reason=f"{plan.chosen.reason}; {note}")
                verdicts = tuple(chosen if v is plan.chosen else v for v in plan.verdicts)
                plan = dataclasses.replace(plan, chosen=chosen, verdicts=verdicts)
        return plan

    def _plan_model(
        self, name: str, version_dir: Path, config: Any, where: str | None, lean: bool
    ) -> ModelPlan:
        pins = read_pins(config, where or f"{name}/config.pbtxt")
        tolerance = pins.tolerance if pins.tolerance is not None else self.settings.runtime.accuracy_tolerance
        verdicts: list[Verdict] = []
        chosen: Verdict | None = None
        seen: set[PlanOption] = set()
        for option, cand in self._options(pins):
            reason, artifact, note = self._static(option, cand, pins, version_dir, config, lean)
            if reason is None and artifact is not None and artifact.suffix in (".plan", ".engine"):
                # a shipped engine runs as built: its precision was fixed when it was built
                option = PlanOption(option.backend, option.device, "auto", option.providers)
                note = "model.plan runs as built (precision fixed at build time)"
            if option in seen:
                continue
            seen.add(option)
            if reason is not None:
                verdicts.append(Verdict(option, False, reason, artifact))
                continue
            assert artifact is not None
            needs_guard = option.precision not in ("fp32", "auto") and option.precision not in pins.allowed
            if chosen is not None:
                verdicts.append(
                    Verdict(
                        option,
                        not needs_guard,
                        note or "viable (lower preference)"
                        if not needs_guard
                        else "lower precision after the choice: not guarded, not a fallback",
                        artifact,
                        checked=False,
                    )
                )
                continue
            if not needs_guard:
                why = "allowed by config parameters.precision" if option.precision in pins.allowed else ""
                verdict = Verdict(
                    option, True, "; ".join(x for x in (why, note) if x) or "first viable option", artifact
                )
            elif self.guard is None:
                verdict = Verdict(
                    option,
                    True,
                    "; ".join(
                        x
                        for x in (
                            note,
                            f"accuracy guard (tolerance {tolerance:g}) runs on this device at load",
                        )
                        if x
                    ),
                    artifact,
                )
            else:
                result = self.check_accuracy(artifact, option, tolerance, name, version_dir, config, where)
                verdict = Verdict(option, result.ok, "accuracy guard: " + result.reason, artifact)
            verdicts.append(verdict)
            if verdict.ok:
                chosen = verdict
        version = version_dir.name if version_dir.name.isdigit() else None
        if chosen is None:
            why = (
                "; ".join(f"{v.option.label()}: {v.reason}" for v in verdicts)
                or "no candidates in the profile"
            )
            target = f"pinned {pins.backend_why}" if pins.backend else f"profile {self.profile.name}"
            return ModelPlan(
                name,
                version,
                None,
                None,
                tuple(verdicts),
                pins,
                f"no option can run it here ({target}): {why}",
            )
        return ModelPlan(
            name, version, chosen, self.backend_options(chosen.option, config, pins), tuple(verdicts), pins
        )

    def check_accuracy(
        self, artifact: Path, option: PlanOption, tolerance: float, name: str, version_dir: Path,
        config: Any, where: str | None,
    ) -> GuardResult:  # fmt: skip
        """The guard's verdict, on the model's representative inputs when it ships some."""
        assert self.guard is not None
        from edgeserve.hardware.inputs import model_inputs

        inputs = model_inputs(name, version_dir.parent, config, where or "")
        if inputs is None:
            return self.guard(artifact, option, tolerance)
        guard: Any = self.guard  # accuracy.AccuracyGuard takes the inputs as a 4th argument
        result: GuardResult = guard(artifact, option, tolerance, inputs)
        return result

    def backend_options(self, option: PlanOption, config: Any, pins: Pins | None = None) -> BackendOptions:
        runtime = self.settings.runtime
        instances = sum(max(int(g.count), 1) for g in getattr(config, "instance_group", [])) or 1
        threads, _ = self.threads(instances)
        params = {
            "ort_memory_arena": memory.ort_memory_arena(runtime.ort_memory_arena, self.memory_profile()),
            "ort_allow_spinning": "true" if runtime.ort_allow_spinning else "false",
        }
        if option.backend == "openvino" and self.profile.streams:
            params["NUM_STREAMS"] = str(self.profile.streams)
        params.update(parameters(config))
        if pins is not None and pins.backend == option.backend:
            params[PINNED_PARAMETER] = option.backend
        hint = params.get("performance_hint", runtime.openvino_performance_hint).upper()
        cache = runtime.cache_dir
        if cache is None and option.backend == "tensorrt":
            cache = self.settings.server.state_dir / "cache"
        return BackendOptions(
            device=option.device,
            precision=option.precision,
            threads=threads,
            providers=option.providers,
            performance_hint=hint,
            cache_dir=(cache / option.backend) if cache is not None else None,
            parameters=params,
        )


def _short(provider: str) -> str:
    return provider.removesuffix("ExecutionProvider")


def _dynamic_dims(config: Any) -> bool:
    """True when the config declares a dynamic (-1) dim beyond the batch axis."""
    try:
        return any(-1 in list(t.dims) for t in (*config.input, *config.output))
    except (AttributeError, TypeError):
        return False
