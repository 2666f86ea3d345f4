"""Which backend serves a model version, with which options.

`BackendSelector` is injectable (`ModelRepository(settings, selector=...)`): the hardware-aware
selector (device profile + runtime plan) replaces `DefaultSelector`, which decides from the config
and what is installed: config.backend, else config.platform, else the first backend in
BACKEND_MODULES order that is importable here and whose artifact is in the version folder.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends import memory
from edgeserve.backends.base import (
    BACKEND_MODULES,
    PINNED_PARAMETER,
    PLATFORM_BACKEND,
    Backend,
    BackendOptions,
    get_backend,
)
from edgeserve.config import Settings
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository.autocomplete import instance_count
from edgeserve.repository.layout import find_artifact


@dataclass(frozen=True)
class BackendChoice:
    backend_name: str
    model_path: Path  # the artifact in the version folder (file, or folder such as model.onnx/)
    options: BackendOptions
    reason: str  # why this backend, for logs and `edgeserve models`
    # Tried in order when this choice fails to load (only for automatic choices).
    fallbacks: tuple[BackendChoice, ...] = ()
    instances: int = 0  # instances to load when the config does not set a count (0 = the config's)
    shown: Mapping[str, str] = field(default_factory=dict)  # put into the served config's parameters
    # The batch size the race measured (its knee), where the config leaves max_batch_size open: the
    # preferred batch size, and max_batch_size when above auto-complete's default (0 = the default)
    batch: int = 0


class BackendSelector(Protocol):
    def choose(self, model_name: str, model_dir: Path, version_dir: Path, config: Any) -> BackendChoice: ...


def cpu_budget() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 `cpu.max` quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, quota)
    return max(1, count)


def _cgroup_cpu_quota() -> int | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            candidate = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cpu.max"
            for path in (candidate, Path("/sys/fs/cgroup/cpu.max")):
                try:
                    quota, period = path.read_text().split()[:2]
                except (OSError, ValueError):
                    continue
                if quota == "max":
                    return None
                return max(1, math.ceil(int(quota) / int(period)))
    return None


def _gpu_device(config: Any) -> str | None:
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            return f"GPU:{group.gpus[0]}" if group.gpus else "GPU"
    return None


class DefaultSelector:
    def __init__(self, settings: Settings, cpus: int | None = None) -> None:
        self.settings = settings
        self.cpus = cpus if cpus is not None else cpu_budget()

    def options(self, backend_name: str, config: Any, pinned: bool = False) -> BackendOptions:
        runtime = self.settings.runtime
        threads = runtime.cpu_threads or max(1, self.cpus // instance_count(config))
        gpu = _gpu_device(config)
        params = {
            "ort_memory_arena": memory.ort_memory_arena(runtime.ort_memory_arena),
            "ort_allow_spinning": "true" if runtime.ort_allow_spinning else "false",
        }
        params.update({k: v.string_value for k, v in config.parameters.items()})
        if pinned:
            params[PINNED_PARAMETER] = backend_name
        providers = ("CUDAExecutionProvider",) if gpu and backend_name == "onnxruntime" else ()
        cache = runtime.cache_dir
        if cache is None and backend_name == "tensorrt":
            # Never beside the model: a bundle's version folder must hold only what its manifest lists.
            cache = self.settings.server.state_dir / "cache" / "tensorrt"
        return BackendOptions(
            device=gpu or "CPU",
            precision="fp32",
            threads=threads,
            providers=providers,
            performance_hint=runtime.openvino_performance_hint,
            cache_dir=cache,
            parameters=params,
        )

    def _artifact(self, backend: Backend, version_dir: Path, config: Any) -> Path | None:
        names = (config.default_model_filename,) if config.default_model_filename else backend.artifacts
        return find_artifact(version_dir, names)

    def _explicit(self, name: str, why: str, version_dir: Path, config: Any, where: str) -> BackendChoice:
        backend = get_backend(name)  # InferenceError for unknown / not installed backends
        reason = backend.unavailable_reason()
        if reason is not None:
            raise InferenceError(
                Status.UNAVAILABLE, f"{where}: backend '{name}' is not available here: {reason}"
            )
        artifact = self._artifact(backend, version_dir, config)
        if artifact is None:
            names = config.default_model_filename or ", ".join(backend.artifacts)
            problem = f"no model file for backend '{name}' (looked for {names})"
            raise RepositoryError(str(version_dir), "", problem, Status.NOT_FOUND)
        return BackendChoice(name, artifact, self.options(name, config, pinned=True), why)

    def choose(self, model_name: str, model_dir: Path, version_dir: Path, config: Any) -> BackendChoice:
        where = str(model_dir / "config.pbtxt")
        if config.backend:
            return self._explicit(
                config.backend, f"config backend '{config.backend}'", version_dir, config, where
            )
        if config.platform:
            name = PLATFORM_BACKEND.get(config.platform)
            if name is None:
                raise RepositoryError(where, "platform", f"'{config.platform}' is not supported; use one of "
                                      f"{', '.join(sorted(PLATFORM_BACKEND))} or set backend")  # fmt: skip
            return self._explicit(name, f"config platform '{config.platform}'", version_dir, config, where)
        candidates: list[BackendChoice] = []
        skipped: list[str] = []
        for name in BACKEND_MODULES:
            try:
                backend = get_backend(name)
            except InferenceError:
                continue  # backend module not in this build
            artifact = self._artifact(backend, version_dir, config)
            if artifact is None:
                continue
            unavailable = backend.unavailable_reason()
            if unavailable is not None:
                skipped.append(f"{name} ({unavailable})")
                continue
            why = f"first available backend for {artifact.name}"
            if skipped:
                why += f"; skipped {', '.join(skipped)}"
            candidates.append(BackendChoice(name, artifact, self.options(name, config), why))
        if not candidates:
            found = sorted(p.name for p in version_dir.iterdir()) if version_dir.is_dir() else []
            detail = f"; unavailable: {', '.join(skipped)}" if skipped else ""
            problem = f"no backend here can serve it (files: {', '.join(found) or 'none'}{detail})"
            raise RepositoryError(str(version_dir), "", problem, Status.NOT_FOUND)
        first = candidates[0]
        return BackendChoice(first.backend_name, first.model_path, first.options, first.reason,
                             tuple(candidates[1:]))  # fmt: skip
