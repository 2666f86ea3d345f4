"""TensorRT engines built on the device: optimization-profile shapes, the engine cache and the build.

Pure parts (shape specs, profile derivation, cache keys, manifest checks) run anywhere and are unit
tested without a GPU. `build_engine` needs `tensorrt` and runs in a child process
(`python -m edgeserve.backends.trt_engine build ...`) so a long or crashing build never takes the
server down; the parent relays the builder's progress lines and says "still building" meanwhile.

Cache layout: <cache_dir>/<key>.plan + <key>.json (manifest). The key covers everything that makes an
engine unusable elsewhere: the ONNX file's sha256, GPU name and compute capability (and Jetson SoC /
L4T), TensorRT version, precision, optimization-profile shapes, DLA core. Both files are sealed
(backends/cache.py): an engine is executable code (its plugins run on deserialization), so one that
edgeserve did not write, or that changed since, is discarded and built again, never deserialized.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.backends.cache import Rejected, discard, read_sealed, seal_existing, why_not_ours, write_sealed

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input -> (min, opt, max)
STILL_BUILDING_EVERY_S = 30.0


@dataclass(frozen=True)
class EngineSpec:
    precision: str = "fp16"  # fp32 | fp16 | bf16 | int8
    max_batch: int = 0  # config max_batch_size: dim 0 of every input is the batch axis when > 0
    opt_batch: int = 1  # what the builder tunes for (largest preferred_batch_size, else 1)
    min_shapes: Mapping[str, Shape] = field(default_factory=dict)  # explicit, full shapes
    opt_shapes: Mapping[str, Shape] = field(default_factory=dict)
    max_shapes: Mapping[str, Shape] = field(default_factory=dict)
    dla_core: int | None = None
    workspace_mb: int = 1024

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("min_shapes", "opt_shapes", "max_shapes"):
            data[key] = {k: list(v) for k, v in sorted(dict(data[key]).items())}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineSpec:
        shapes = {k: {n: tuple(int(x) for x in v) for n, v in dict(data.get(k, {})).items()}
                  for k in ("min_shapes", "opt_shapes", "max_shapes")}  # fmt: skip
        return cls(
            precision=str(data.get("precision", "fp16")),
            max_batch=int(data.get("max_batch", 0)),
            opt_batch=int(data.get("opt_batch", 1)),
            dla_core=None if data.get("dla_core") is None else int(data["dla_core"]),
            workspace_mb=int(data.get("workspace_mb", 1024)),
            **shapes,
        )


def parse_shapes(text: str | None) -> dict[str, Shape]:
    """trtexec / ORT TensorRT EP syntax: 'images:1x3x640x640,mask:1x640' -> {name: shape}."""
    shapes: dict[str, Shape] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"'{item}' is not name:AxBxC")
        try:
            shapes[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ValueError(f"'{item}': dims must be integers separated by 'x'") from None
    return shapes


def spec_from_config(config: Any, precision: str, device: str = "GPU") -> EngineSpec:
    """EngineSpec from a model config: max_batch_size, preferred batch sizes and the parameters
    trt_profile_min_shapes / trt_profile_opt_shapes / trt_profile_max_shapes (ORT TensorRT EP names)."""
    params: dict[str, str] = {}
    with contextlib.suppress(AttributeError):
        params = {k: v.string_value for k, v in config.parameters.items()}
    max_batch = int(getattr(config, "max_batch_size", 0) or 0)
    preferred = list(getattr(getattr(config, "dynamic_batching", None), "preferred_batch_size", []) or [])
    dla = int(device.partition(":")[2] or 0) if device.upper().startswith("DLA") else None
    return EngineSpec(
        precision=precision if precision in ("fp32", "fp16", "bf16", "int8") else "fp16",
        max_batch=max_batch,
        opt_batch=max(preferred) if preferred else 1,
        min_shapes=parse_shapes(params.get("trt_profile_min_shapes")),
        opt_shapes=parse_shapes(params.get("trt_profile_opt_shapes")),
        max_shapes=parse_shapes(params.get("trt_profile_max_shapes")),
        dla_core=dla,
        workspace_mb=int(params.get("trt_max_workspace_mb", "1024")),
    )


def derive_profile(inputs: Mapping[str, Shape], spec: EngineSpec) -> Profile:
    """(min, opt, max) per network input; -1 dims come from the explicit shapes or the batch axis."""
    profile: Profile = {}
    for name, dims in inputs.items():
        explicit = [spec.min_shapes.get(name), spec.opt_shapes.get(name), spec.max_shapes.get(name)]
        if any(s is not None for s in explicit):
            if any(s is None for s in explicit):
                raise ValueError(f"input '{name}': give min, opt and max shapes together")
            lo, mid, hi = (tuple(s) for s in explicit if s is not None)
            if not len(lo) == len(mid) == len(hi) == len(dims):
                raise ValueError(f"input '{name}' has rank {len(dims)}; the profile shapes do not")
            for i, (d, a, b, c) in enumerate(zip(dims, lo, mid, hi, strict=True)):
                if not 0 < a <= b <= c or (d >= 0 and not a == b == c == d):
                    raise ValueError(f"input '{name}' dim {i}: need min <= opt <= max (and = {d} if fixed)")
            profile[name] = (lo, mid, hi)
            continue
        lo_l: list[int] = []
        mid_l: list[int] = []
        hi_l: list[int] = []
        for i, d in enumerate(dims):
            if d >= 0:
                triple = (d, d, d)
            elif i == 0 and spec.max_batch > 0:
                triple = (1, min(max(spec.opt_batch, 1), spec.max_batch), spec.max_batch)
            else:
                raise ValueError(
                    f"input '{name}' dim {i} is dynamic: set parameters trt_profile_min_shapes, "
                    f"trt_profile_opt_shapes and trt_profile_max_shapes (e.g. '{name}:1x3x320x320')"
                )
            lo_l.append(triple[0])
            mid_l.append(triple[1])
            hi_l.append(triple[2])
        profile[name] = (tuple(lo_l), tuple(mid_l), tuple(hi_l))
    return profile


@dataclass(frozen=True)
class DeviceIdentity:
    name: str  # CUDA device name, e.g. "NVIDIA GeForce RTX 3080" / "Orin"
    compute_capability: str  # "8.6"
    soc: str | None = None  # Jetson SoC, e.g. tegra234
    l4t: str | None = None  # Jetson L4T release (JetPack upgrades change TensorRT)


def manifest_for(
    onnx_sha256: str, device: DeviceIdentity, trt_version: str, spec: EngineSpec
) -> dict[str, Any]:
    return {
        "onnx_sha256": onnx_sha256,
        "device": asdict(device),
        "tensorrt": trt_version,
        "spec": spec.to_json(),
    }


def cache_key(onnx_sha256: str, device: DeviceIdentity, trt_version: str, spec: EngineSpec) -> str:
    canonical = json.dumps(manifest_for(onnx_sha256, device, trt_version, spec), sort_keys=True)
    cc = device.compute_capability.replace(".", "")
    return f"sm{cc}_trt{trt_version}_{spec.precision}_{hashlib.sha256(canonical.encode()).hexdigest()[:24]}"


def manifest_mismatch(manifest: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """Why a cached engine does not fit this box (None when it does)."""
    for key, label in (("tensorrt", "TensorRT version"), ("device", "GPU"), ("onnx_sha256", "ONNX file"),
                       ("spec", "precision / profile shapes")):  # fmt: skip
        if manifest.get(key) != expected.get(key):
            return f"{label} differs (engine: {manifest.get(key)!r}, here: {expected.get(key)!r})"
    return None


ENGINE = "the cached TensorRT engine"


class EngineCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def plan_path(self, key: str) -> Path:
        return self.root / f"{key}.plan"

    def lookup(self, key: str, expected: Mapping[str, Any]) -> bytes | None:
        """The verified engine bytes for `key` (never a path: nothing to swap before deserializing)."""
        plan, meta = self.plan_path(key), self.root / f"{key}.json"
        raw = read_sealed(meta, "the cached TensorRT engine's manifest")
        if raw is None:
            return None
        try:
            manifest = json.loads(raw)
        except ValueError:
            discard(meta, "the cached TensorRT engine's manifest", "it is not JSON")
            return None
        if not isinstance(manifest, dict) or manifest_mismatch(manifest, expected) is not None:
            return None
        return read_sealed(plan, ENGINE)

    def store(self, key: str, built: Path, manifest: Mapping[str, Any]) -> bytes:
        """Move the engine a build wrote into the cache and seal it; its verified bytes. Raises
        Rejected when `built` is not a file only edgeserve could have written."""
        self.root.mkdir(parents=True, exist_ok=True)
        reason = why_not_ours(os.lstat(built))
        if reason is not None:
            built.unlink(missing_ok=True)
            raise Rejected(f"the engine build's output {built}: {reason}")
        target = self.plan_path(key)
        os.replace(built, target)
        seal_existing(target)
        meta = json.dumps({**manifest, "built_at": time.time()}, indent=1, sort_keys=True)
        write_sealed(self.root / f"{key}.json", meta.encode())
        data = read_sealed(target, ENGINE)
        if data is None:
            raise Rejected(f"{target} changed before it could be loaded")
        return data


def build_in_subprocess(onnx: Path, out: Path, spec: EngineSpec, progress: Callable[[str], None],
                        timeout_s: float | None = None) -> None:  # fmt: skip
    """Build `out` from `onnx` in a child process, relaying its progress; raises RuntimeError on failure."""
    cmd = [sys.executable, "-m", "edgeserve.backends.trt_engine", "build", str(onnx), str(out),
           json.dumps(spec.to_json())]  # fmt: skip
    started = time.monotonic()
    progress(f"building TensorRT engine for {onnx.name} ({spec.precision}); this can take minutes")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name="trt-build-log").start()
    tail: list[str] = []
    while True:
        try:
            line = lines.get(timeout=STILL_BUILDING_EVERY_S)
        except queue.Empty:
            progress(f"still building the engine for {onnx.name} ({time.monotonic() - started:.0f}s)")
        else:
            if line is None:
                break
            tail = [*tail[-19:], line]
            progress(line)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            proc.kill()
            raise RuntimeError(f"engine build for {onnx.name} took over {timeout_s:.0f}s; killed")
    code = proc.wait()
    if code != 0 or not out.is_file():
        raise RuntimeError(f"engine build for {onnx.name} failed (exit {code}): " + " | ".join(tail[-8:]))
    progress(f"engine for {onnx.name} built in {time.monotonic() - started:.0f}s")


def build_engine(onnx: Path, out: Path, spec: EngineSpec) -> None:  # pragma: no cover - needs TensorRT + GPU
    """Runs in the child process: parse the ONNX, set precision/profile/DLA, build, write the plan."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise SystemExit("ONNX parse failed: " + "; ".join(errors))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_mb * 2**20)
    flag = {"fp16": "FP16", "bf16": "BF16", "int8": "INT8"}.get(spec.precision)
    if flag:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if spec.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = spec.dla_core
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    if any(d < 0 for dims in inputs.values() for d in dims):
        profile = builder.create_optimization_profile()
        for name, (lo, mid, hi) in derive_profile(inputs, spec).items():
            profile.set_shape(name, lo, mid, hi)
        config.add_optimization_profile(profile)
    if hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = _progress_monitor(trt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit("TensorRT could not build the engine (see the log above)")
    write_private(out, bytes(serialized))


def write_private(out: Path, data: bytes) -> None:
    """Write `out` through a fresh 0600 file: the cache folder may be group-writable, and a name that
    someone else created first (their file, which they could keep writing) is replaced, not reused."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)


def _progress_monitor(trt: Any) -> Any:  # pragma: no cover - needs TensorRT
    class Monitor(trt.IProgressMonitor):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.steps[phase_name] = num_steps
            print(f"phase {phase_name}: {num_steps} steps", flush=True)

        def step_complete(self, phase_name: str, step: int) -> bool:
            total = self.steps.get(phase_name, 0)
            if total and (step + 1) % max(1, total // 10) == 0:
                print(f"phase {phase_name}: {step + 1}/{total}", flush=True)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            print(f"phase {phase_name}: done", flush=True)

    return Monitor()


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the child process entry
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[0] != "build":
        print(
            "usage: python -m edgeserve.backends.trt_engine build MODEL.onnx OUT.plan SPEC_JSON",
            file=sys.stderr,
        )
        return 2
    build_engine(Path(args[1]), Path(args[2]), EngineSpec.from_json(json.loads(args[3])))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
