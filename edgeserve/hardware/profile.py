"""Device profiles: one TOML per platform family (`devices/*.toml` + a user folder), matched to the probes.

A profile says when it applies (`[match]`), which backend/device/precision options to try in order
(`[[candidates]]`), the measurements that order its CPU candidates on each kind of CPU
(`[[measurements]]`, evidence.py) and the thread/stream/memory defaults (`[runtime]`). Adding a
platform is adding a file; see devices/README.md for the format. The most specific matching profile
wins: the one with the most `[match]` conditions, then the higher `priority`, then the name.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.hardware.evidence import EvidenceError, Measurement, parse_measurements
from edgeserve.hardware.probes import HardwareInfo

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("edgeserve.hardware.profile")

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "auto")  # auto: as compiled into the artifact (Neuron)
BACKENDS = ("tensorrt", "openvino", "onnxruntime", "neuron", "python")
MATCH_KEYS = (
    "arch",
    "jetson",
    "jetson_soc",
    "nvidia_dgpu",
    "intel_igpu",
    "intel_npu",
    "neuron",
    "board_family",
    "cpu_features",
    "min_memory_mb",
    "any",
)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Candidate:
    backend: str
    device: str = "CPU"
    precisions: tuple[str, ...] = ("fp32",)
    providers: tuple[str, ...] = ()  # onnxruntime execution providers, in order (CPU is always last)
    min_model_bytes: int = 0  # below this the runtime's fixed per-call cost dominates: skip it
    note: str = ""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    source: str
    match: Mapping[str, Any]
    candidates: tuple[Candidate, ...]
    priority: int = 0
    threads: int = 0  # 0 = effective CPUs (cgroup-aware) minus reserve_cores
    reserve_cores: int = 0  # CPUs left to the camera pipeline / OS
    streams: int = 0  # OpenVINO NUM_STREAMS / concurrent contexts; 0 = the runtime's hint decides
    memory_headroom_mb: int = 256  # kept free for the OS and the rest of the appliance
    memory_factor: float = 3.0  # peak RSS of a loaded model ≈ factor x its file size
    measurements: tuple[Measurement, ...] = ()  # what orders the CPU candidates (evidence.py)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def specificity(self) -> int:
        return len(self.match)


def _conditions(hw: HardwareInfo) -> dict[str, Any]:
    """The facts profiles match against."""
    return {
        "arch": hw.cpu.arch,
        "jetson": hw.jetson is not None,
        "jetson_soc": hw.jetson.soc if hw.jetson else None,
        "nvidia_dgpu": hw.nvidia_dgpu is not None,
        "intel_igpu": bool(hw.intel.gpus),
        "intel_npu": bool(hw.intel.npus),
        "neuron": hw.neuron is not None,
        "board_family": hw.board.family,
        "cpu_features": set(hw.cpu.isa),
        "memory_mb": (hw.budget.memory_bytes or 0) // 2**20,
    }


def _holds(key: str, wanted: Any, facts: Mapping[str, Any]) -> bool:
    if key == "any":
        return any(all(_holds(k, v, facts) for k, v in alt.items()) for alt in wanted)
    if key == "cpu_features":
        return bool(set(wanted) <= facts["cpu_features"])
    if key == "min_memory_mb":
        return bool(facts["memory_mb"] >= int(wanted))
    value = facts.get(key)
    if isinstance(wanted, bool):
        return bool(value) == wanted
    if isinstance(wanted, list):
        return value in wanted
    return bool(value == wanted)


def matches(profile: DeviceProfile, hw: HardwareInfo) -> bool:
    facts = _conditions(hw)
    return all(_holds(key, wanted, facts) for key, wanted in profile.match.items())


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProfileError(f"{where}: expected a list of strings, got {value!r}")
    return tuple(value)


def _candidate(raw: Any, where: str) -> Candidate:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: each [[candidates]] entry must be a table")
    unknown = set(raw) - {"backend", "device", "precisions", "providers", "min_model_bytes", "note"}
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}")
    backend = raw.get("backend")
    if backend not in BACKENDS:
        raise ProfileError(f"{where}.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    precisions = _str_list(raw.get("precisions", ["fp32"]), f"{where}.precisions")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise ProfileError(f"{where}.precisions: {bad or 'empty'}; use {', '.join(PRECISIONS)}")
    min_bytes = raw.get("min_model_bytes", 0)
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise ProfileError(f"{where}.min_model_bytes: expected a non-negative integer")
    return Candidate(
        backend=str(backend),
        device=str(raw.get("device", "CPU")).upper(),
        precisions=precisions,
        providers=_str_list(raw.get("providers", []), f"{where}.providers"),
        min_model_bytes=min_bytes,
        note=str(raw.get("note", "")),
    )


def parse_profile(data: Mapping[str, Any], source: str) -> DeviceProfile:
    name = data.get("name") or Path(source).stem
    match = data.get("match", {})
    if not isinstance(match, Mapping):
        raise ProfileError(f"{source}: [match] must be a table")
    unknown = set(match) - set(MATCH_KEYS)
    if unknown:
        raise ProfileError(
            f"{source}: match: unknown condition(s) {sorted(unknown)}; known: {', '.join(MATCH_KEYS)}"
        )
    raw_candidates = data.get("candidates", [])
    if not isinstance(raw_candidates, list) or not raw_candidates:
        raise ProfileError(f"{source}: needs at least one [[candidates]] entry")
    candidates = tuple(_candidate(c, f"{source}: candidates[{i}]") for i, c in enumerate(raw_candidates))
    try:
        measurements = parse_measurements(data.get("measurements", []), source)
    except EvidenceError as exc:
        raise ProfileError(str(exc)) from None
    runtime = data.get("runtime", {})
    if not isinstance(runtime, Mapping):
        raise ProfileError(f"{source}: [runtime] must be a table")

    def number(key: str, default: float, kind: type = int) -> Any:
        value = runtime.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ProfileError(f"{source}: runtime.{key}: expected a non-negative number, got {value!r}")
        return kind(value)

    return DeviceProfile(
        name=str(name),
        description=str(data.get("description", "")),
        source=source,
        match=dict(match),
        candidates=candidates,
        priority=int(data.get("priority", 0)),
        threads=number("threads", 0),
        reserve_cores=number("reserve_cores", 0),
        streams=number("streams", 0),
        memory_headroom_mb=number("memory_headroom_mb", 256),
        memory_factor=number("memory_factor", 3.0, float),
        measurements=measurements,
        extra={
            k: v
            for k, v in data.items()
            if k not in ("name", "description", "match", "candidates", "runtime", "priority", "measurements")
        },
    )


def load_profile(path: Path) -> DeviceProfile:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    return parse_profile(data, str(path))


def builtin_dirs() -> list[Path]:
    """Where the shipped profiles live: $EDGESERVE_DEVICES_DIR, the source tree's devices/, system folders."""
    dirs: list[Path] = []
    env = os.environ.get("EDGESERVE_DEVICES_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(Path(__file__).resolve().parents[2] / "devices")
    dirs += [Path(sys.prefix) / "share" / "edgeserve" / "devices", Path("/usr/share/edgeserve/devices")]
    return dirs


# Used only when no profile folder is found at all (a bare wheel install): plain CPU serving.
FALLBACK = DeviceProfile(
    name="generic-cpu",
    description="built-in fallback: no devices/ folder found",
    source="<built-in>",
    match={},
    candidates=(
        Candidate("openvino", "CPU", ("fp32",), min_model_bytes=65536),
        Candidate("onnxruntime", "CPU", ("fp32",)),
    ),
    priority=-100,
)


def load_profiles(
    extra: Iterable[Path | None] = (), *, builtin: Iterable[Path] | None = None
) -> list[DeviceProfile]:
    """Profiles from the first existing built-in folder, then each extra folder (a user's profile replaces a
    built-in one of the same name). A broken user file is logged and skipped, never fatal."""
    profiles: dict[str, DeviceProfile] = {}
    base = next((d for d in (builtin if builtin is not None else builtin_dirs()) if d.is_dir()), None)
    for folder in [base, *extra]:
        if folder is None or not folder.is_dir():
            if folder is not None:
                log.warning("device profile folder %s does not exist", folder)
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                profile = load_profile(path)
            except ProfileError as exc:
                log.error("ignoring device profile: %s", exc)
                continue
            profiles[profile.name] = profile
    return list(profiles.values()) or [FALLBACK]


def match_profile(hw: HardwareInfo, profiles: Iterable[DeviceProfile]) -> DeviceProfile:
    """The most specific profile whose conditions all hold (the fallback when none does)."""
    fitting = [p for p in profiles if matches(p, hw)]
    if not fitting:
        return FALLBACK
    return max(fitting, key=lambda p: (p.specificity(), p.priority, p.name))
