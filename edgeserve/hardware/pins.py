"""What a model's config asks of the plan: a pinned backend/device/precision, a tolerance, its artifacts.

config.pbtxt knobs (all optional; Triton's own fields where one exists):
    backend: "openvino"                      pins the backend (Triton field)
    platform: "onnxruntime_onnx"             pins the backend via Triton's platform name
    instance_group [{ kind: KIND_GPU }]      pins a GPU device (KIND_CPU pins the CPU)
    default_model_filename: "model.xml"      the artifact to use (Triton field)
    parameters { key: "device" value: { string_value: "NPU" } }          CPU | GPU[:n] | NPU | AUTO | DLA:n
    parameters { key: "precision" value: { string_value: "bf16" } }      fp32 forbids lower precisions;
                                         fp16 / bf16 / int8 allow that precision without the accuracy guard
    parameters { key: "accuracy_tolerance" value: { string_value: "0.05" } }   this model's guard tolerance
    optimization { execution_accelerators { gpu_execution_accelerator [{ name: "tensorrt"
        parameters { key: "precision_mode" value: "FP16" } }] } }       Triton's way to allow fp16 on TensorRT
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.protocol.errors import InferenceError, Status

PLATFORM_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "openvino": "openvino",
    "pytorch_libtorch": "neuron",
    "python": "python",
}
# backend -> default artifact names, in the order the backend prefers them
ARTIFACTS: dict[str, tuple[str, ...]] = {
    "tensorrt": ("model.plan", "model.onnx"),
    "openvino": ("model.xml", "model.onnx"),
    "onnxruntime": ("model.onnx",),
    "neuron": ("model.pt",),
    "python": ("model.py",),
}
_SUFFIX_BACKENDS = {
    ".plan": ("tensorrt",),
    ".engine": ("tensorrt",),
    ".onnx": ("tensorrt", "openvino", "onnxruntime"),
    ".xml": ("openvino",),
    ".pt": ("neuron",),
    ".py": ("python",),
}
_KIND_GPU, _KIND_CPU = 1, 2  # ModelInstanceGroup.Kind values (KIND_AUTO = 0)
PRECISION_NAMES = ("fp32", "fp16", "bf16", "int8", "auto")


@dataclass(frozen=True)
class Pins:
    backend: str | None = None
    backend_why: str = ""  # e.g. "config backend 'openvino'"
    device: str | None = None
    device_why: str = ""
    precision: str | None = None  # fp32 = full precision only; others = allowed without the guard
    allowed: frozenset[str] = frozenset()  # lower precisions the config vouches for
    tolerance: float | None = None
    filename: str | None = None  # default_model_filename


def _param(config: Any, key: str) -> str | None:
    if config is None:
        return None
    try:
        value = config.parameters[key].string_value if key in config.parameters else None
    except (AttributeError, TypeError, KeyError):
        return None
    return value.strip() if value else None


def parameters(config: Any) -> dict[str, str]:
    try:
        return {k: v.string_value for k, v in config.parameters.items()}
    except AttributeError:
        return {}


def read_pins(config: Any, where: str = "config.pbtxt") -> Pins:
    """The config's pins; an unknown backend/platform/precision is INVALID_ARG naming the field."""
    if config is None:
        return Pins()
    backend = why = None
    if getattr(config, "backend", ""):
        backend, why = config.backend, f"config backend '{config.backend}'"
        if backend not in ARTIFACTS:
            raise InferenceError(
                Status.INVALID_ARG,
                f"{where}: backend '{backend}' is unknown; edgeserve has {', '.join(sorted(ARTIFACTS))}",
            )
    elif getattr(config, "platform", ""):
        backend, why = PLATFORM_BACKEND.get(config.platform), f"config platform '{config.platform}'"
        if backend is None:
            raise InferenceError(
                Status.INVALID_ARG,
                f"{where}: platform '{config.platform}' is not supported; use "
                f"{', '.join(sorted(PLATFORM_BACKEND))} or set backend",
            )

    device = _param(config, "device")
    device_why = "config parameter device" if device else ""
    if device is None:
        kinds = [(g.kind, list(g.gpus)) for g in getattr(config, "instance_group", [])]
        gpu = next((gpus for kind, gpus in kinds if kind == _KIND_GPU), None)
        if gpu is not None:
            device, device_why = (f"GPU:{gpu[0]}" if gpu else "GPU"), "config instance_group KIND_GPU"
        elif kinds and all(kind == _KIND_CPU for kind, _ in kinds):
            device, device_why = "CPU", "config instance_group KIND_CPU"
    device = device.upper() if device else None

    precision = _param(config, "precision")
    if precision is not None:
        precision = precision.lower()
        if precision not in PRECISION_NAMES:
            raise InferenceError(
                Status.INVALID_ARG,
                f"{where}: parameters.precision '{precision}' is not one of {', '.join(PRECISION_NAMES)}",
            )
    allowed = {precision} if precision and precision != "fp32" else set()
    try:
        for accel in config.optimization.execution_accelerators.gpu_execution_accelerator:
            mode = dict(accel.parameters).get("precision_mode", "").lower()
            if mode in ("fp16", "int8"):
                allowed.add(mode)
    except AttributeError:
        pass

    tolerance = None
    raw = _param(config, "accuracy_tolerance")
    if raw is not None:
        try:
            tolerance = float(raw)
        except ValueError:
            raise InferenceError(
                Status.INVALID_ARG, f"{where}: parameters.accuracy_tolerance '{raw}' is not a number"
            ) from None
    filename = getattr(config, "default_model_filename", "") or None
    return Pins(backend, why or "", device, device_why, precision, frozenset(allowed), tolerance, filename)


def find_artifact(backend: str, version_dir: Path, filename: str | None) -> Path | None:
    """The file `backend` would load from the version folder (a file, or a folder such as model.onnx/)."""
    if filename:
        if backend not in _SUFFIX_BACKENDS.get(Path(filename).suffix.lower(), ()):
            return None
        names: tuple[str, ...] = (filename,)
    else:
        names = ARTIFACTS.get(backend, ())
    for name in names:
        candidate = version_dir / name
        try:
            if candidate.exists():
                return candidate
        except OSError:
            continue
    return None


def artifact_bytes(path: Path) -> int:
    """Bytes the runtime reads: the file, its IR weights (.bin) or the folder's files."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        size = path.stat().st_size
        if path.suffix == ".xml" and path.with_suffix(".bin").exists():
            size += path.with_suffix(".bin").stat().st_size
        return size
    except OSError:
        return 0
