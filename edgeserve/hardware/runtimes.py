"""Which inference runtimes this install can use, found without importing them.

On the live root (`/`) the answer is this interpreter's: `importlib.util.find_spec` plus package
metadata. For any other root (a fixture tree, a mounted device image) it is the Python packages
installed in that tree (`*.dist-info` folders under usr/lib and usr/local/lib), so a captured probe
tree can carry what the device had installed. Either way the result is a plain value that tests inject.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.hardware.probes._fs import FsRoot, key_values

# runtime -> (import name, distributions that provide it)
RUNTIMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "onnxruntime": (
        "onnxruntime",
        (
            "onnxruntime",
            "onnxruntime-gpu",
            "onnxruntime-openvino",
            "onnxruntime-directml",
            "onnxruntime-qnn",
            "onnxruntime-training",
        ),
    ),
    "openvino": ("openvino", ("openvino",)),
    "tensorrt": ("tensorrt", ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt-lean")),
    "cuda": ("cuda.bindings", ("cuda-python", "cuda-bindings")),
    "torch_neuronx": ("torch_neuronx", ("torch-neuronx",)),
    "torch": ("torch", ("torch",)),
}
# ONNX Runtime wheels and the execution providers compiled into each (HARDWARE.md §2.1)
ORT_PROVIDERS: dict[str, tuple[str, ...]] = {
    "onnxruntime-gpu": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
    "onnxruntime-openvino": ("OpenVINOExecutionProvider", "CPUExecutionProvider"),
    "onnxruntime-directml": ("DmlExecutionProvider", "CPUExecutionProvider"),
    "onnxruntime-qnn": ("QNNExecutionProvider", "CPUExecutionProvider"),
}
# backend -> runtimes it needs (all of them)
BACKEND_RUNTIMES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime",),
    "openvino": ("openvino",),
    "tensorrt": ("tensorrt", "cuda"),
    "neuron": ("torch_neuronx", "torch"),
    "python": (),
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class RuntimeStatus:
    name: str
    available: bool
    version: str | None = None
    distribution: str | None = None
    detail: str = ""  # why not, when unavailable

    def describe(self) -> str:
        if not self.available:
            return f"{self.name}: not available ({self.detail})"
        return f"{self.name} {self.version or '?'}" + (f" ({self.distribution})" if self.distribution else "")


@dataclass(frozen=True)
class RuntimeInventory:
    runtimes: dict[str, RuntimeStatus]
    backend_modules: frozenset[str] = frozenset()  # edgeserve.backends.<name> present in this install
    source: str = "this interpreter"
    extra: dict[str, Any] = field(default_factory=dict)

    def status(self, name: str) -> RuntimeStatus:
        return self.runtimes.get(name) or RuntimeStatus(
            name, False, detail=f"python package '{name}' not found"
        )

    def ort_providers(self) -> tuple[str, ...]:
        ort = self.status("onnxruntime")
        if not ort.available:
            return ()
        return ORT_PROVIDERS.get(_norm(ort.distribution or ""), ("CPUExecutionProvider",))

    def backend_unavailable(self, backend: str) -> str | None:
        """None when `backend` can be used here; otherwise the reason."""
        if backend not in BACKEND_RUNTIMES:
            return f"unknown backend '{backend}'"
        if backend not in self.backend_modules:
            return f"module edgeserve.backends.{backend} is not part of this install"
        for runtime in BACKEND_RUNTIMES[backend]:
            status = self.status(runtime)
            if not status.available:
                return status.detail or f"{runtime} not importable"
        return None

    def describe(self) -> list[str]:
        lines = [s.describe() for s in self.runtimes.values()]
        providers = self.ort_providers()
        if providers:
            lines.append("onnxruntime providers: " + ", ".join(providers))
        return lines


def _backend_modules(find_spec: Callable[[str], Any]) -> frozenset[str]:
    present = set()
    for backend in BACKEND_RUNTIMES:
        try:
            if find_spec(f"edgeserve.backends.{backend}") is not None:
                present.add(backend)
        except (ImportError, ValueError):
            pass
    return frozenset(present)


def _live(find_spec: Callable[[str], Any]) -> dict[str, RuntimeStatus]:
    statuses: dict[str, RuntimeStatus] = {}
    for runtime, (module, dists) in RUNTIMES.items():
        try:
            spec = find_spec(module)
        except (ImportError, ValueError) as exc:  # a parent package that fails to import
            spec, error = None, str(exc)
        else:
            error = ""
        if spec is None:
            statuses[runtime] = RuntimeStatus(
                runtime, False, detail=error or f"python package '{module}' not importable"
            )
            continue
        version = dist_name = None
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            dist_name = dist
            break
        statuses[runtime] = RuntimeStatus(runtime, True, version, dist_name)
    return statuses


def _site_dirs(fs: FsRoot) -> Iterable[str]:
    for base in ("usr/lib", "usr/local/lib", "opt/conda/lib", "opt/venv/lib", "usr/lib64"):
        for entry in fs.listdir(base):
            if entry.startswith("python3"):
                for sub in ("dist-packages", "site-packages"):
                    if fs.is_dir(f"{base}/{entry}/{sub}"):
                        yield f"{base}/{entry}/{sub}"
        if base == "usr/lib" and fs.is_dir("usr/lib/python3/dist-packages"):
            yield "usr/lib/python3/dist-packages"


def _from_tree(fs: FsRoot) -> dict[str, RuntimeStatus]:
    found: dict[str, tuple[str, str]] = {}  # normalized dist -> (name, version)
    for site in _site_dirs(fs):
        for entry in fs.listdir(site):
            if not entry.endswith(".dist-info"):
                continue
            meta = key_values(fs.read_text(f"{site}/{entry}/METADATA"))
            stem = entry[: -len(".dist-info")]
            name = meta.get("Name") or stem.rsplit("-", 1)[0]
            version = meta.get("Version") or (stem.rsplit("-", 1)[1] if "-" in stem else "")
            found.setdefault(_norm(name), (name, version))
    statuses: dict[str, RuntimeStatus] = {}
    for runtime, (module, dists) in RUNTIMES.items():
        hit = next((d for d in dists if _norm(d) in found), None)
        if hit is None:
            statuses[runtime] = RuntimeStatus(
                runtime, False, detail=f"python package '{module}' not installed in {fs.root}"
            )
        else:
            statuses[runtime] = RuntimeStatus(runtime, True, found[_norm(hit)][1] or None, _norm(hit))
    return statuses


def detect_runtimes(
    root: Path | str = "/",
    *,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
) -> RuntimeInventory:
    fs = FsRoot(root)
    modules = _backend_modules(find_spec)
    if fs.is_live:
        return RuntimeInventory(_live(find_spec), modules, "this interpreter")
    return RuntimeInventory(_from_tree(fs), modules, f"python packages installed under {fs.root}")


def inventory(
    available: dict[str, str | tuple[str, str]],
    backend_modules: Iterable[str] = ("onnxruntime", "openvino", "tensorrt", "neuron", "python"),
) -> RuntimeInventory:
    """An inventory by hand (tests): {"onnxruntime": ("1.20.0", "onnxruntime-gpu"), "openvino": "2024.4"}."""
    statuses: dict[str, RuntimeStatus] = {}
    for runtime in RUNTIMES:
        value = available.get(runtime)
        if value is None:
            statuses[runtime] = RuntimeStatus(
                runtime, False, detail=f"python package '{runtime}' not installed"
            )
        elif isinstance(value, tuple):
            statuses[runtime] = RuntimeStatus(runtime, True, value[0], _norm(value[1]))
        else:
            statuses[runtime] = RuntimeStatus(runtime, True, value, runtime)
    return RuntimeInventory(statuses, frozenset(backend_modules), "given")
