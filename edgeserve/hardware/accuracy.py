"""The accuracy guard: a lower precision (bf16/fp16) is used only if the config allows it, or if its
outputs stay within a stated tolerance of fp32 on representative inputs: the OTA bundle's checks or
the config's model_warmup samples when the model has them (inputs.py), else 3 deterministic random
inputs on the model's shapes.

The figures are scale-aware, per output (fidelity.py): RMS and worst error relative to the output's
range, cosine similarity, top-1 agreement for score-shaped outputs. They are cached per model file
hash, inputs, backend, device, precision, runtime version and CPU model, so a restart does not measure
again; a changed tolerance re-judges the cached figures without re-running.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.hardware import fidelity
from edgeserve.hardware.digest_cache import DigestCache
from edgeserve.hardware.inputs import ModelInputs
from edgeserve.hardware.plan import GuardResult, PlanOption

log = logging.getLogger("edgeserve.hardware.accuracy")

Array = npt.NDArray[Any]
Feeds = list[dict[str, Array]]
# runner(path, option, feeds) -> (outputs per feed, note or None); note says why the run is not a real test
Runner = Callable[[Path, PlanOption, Feeds], tuple[list[list[Array]], str | None]]
DYNAMIC_BATCH, DYNAMIC_OTHER = 1, 64  # sizes used for dynamic dims (64 suits stride-32 image models)


def model_digest(path: Path) -> str:
    """sha256 over the model's files (an IR's .bin too; every file of a model folder)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if path.suffix == ".xml" and path.with_suffix(".bin").exists():
        files.append(path.with_suffix(".bin"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def relative_error(reference: Sequence[Array], candidate: Sequence[Array]) -> float:
    worst = 0.0
    for ref, out in zip(reference, candidate, strict=True):
        ref64, out64 = np.asarray(ref, dtype=np.float64), np.asarray(out, dtype=np.float64)
        if ref64.shape != out64.shape:
            return float("inf")
        if ref64.size == 0:
            continue
        scale = max(float(np.max(np.abs(ref64))), 1e-12)
        worst = max(worst, float(np.max(np.abs(ref64 - out64))) / scale)
    return worst


def sample_feeds(specs: Sequence[tuple[str, np.dtype[Any], Sequence[int]]], count: int, seed: int) -> Feeds:
    """`count` deterministic random inputs: floats in [0, 1), integers in [0, 8), random booleans."""
    rng = np.random.default_rng(seed)
    feeds: Feeds = []
    for _ in range(count):
        feed: dict[str, Array] = {}
        for name, dtype, dims in specs:
            shape = tuple(
                d if d >= 0 else (DYNAMIC_BATCH if i == 0 else DYNAMIC_OTHER) for i, d in enumerate(dims)
            )
            if dtype == np.bool_:
                feed[name] = rng.random(shape) < 0.5
            elif np.issubdtype(dtype, np.integer):
                feed[name] = rng.integers(0, 8, size=shape).astype(dtype)
            else:
                feed[name] = rng.random(shape).astype(dtype)
        feeds.append(feed)
    return feeds


def _openvino_runner(path: Path, option: PlanOption, feeds: Feeds) -> tuple[list[list[Array]], str | None]:
    from edgeserve.backends.openvino import core as openvino_core

    core = openvino_core()
    model = core.read_model(str(path))
    hints = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
    device = option.device.replace(":", ".")
    compiled = core.compile_model(
        model, device, {"INFERENCE_PRECISION_HINT": hints.get(option.precision, "f32")}
    )
    note = None
    if option.precision != "fp32" and device.startswith("CPU"):
        prop = compiled.get_property("INFERENCE_PRECISION_HINT")
        actual = str(prop.get_type_name() if hasattr(prop, "get_type_name") else prop)
        if actual != hints[option.precision]:
            note = f"openvino ran {actual} although {option.precision} was asked"
    request = compiled.create_infer_request()
    outputs = []
    for feed in feeds:
        result = request.infer(feed)
        outputs.append([np.array(v) for v in result.values()])
    return outputs, note


def _openvino_specs(path: Path) -> list[tuple[str, np.dtype[Any], list[int]]]:
    from edgeserve.backends.openvino import core as openvino_core

    model = openvino_core().read_model(str(path))
    specs = []
    for i, port in enumerate(model.inputs):
        try:
            name = port.get_any_name()
        except RuntimeError:
            name = f"input{i}"
        dtype = np.dtype(port.get_element_type().to_dtype())
        dims = [-1 if d.is_dynamic else int(d.get_length()) for d in port.get_partial_shape()]
        specs.append((name, dtype, dims))
    return specs


def _backend_runner(path: Path, option: PlanOption, feeds: Feeds) -> tuple[list[list[Array]], str | None]:
    """Any edgeserve backend through its public contract (TensorRT, ONNX Runtime EPs)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from edgeserve.backends.base import BackendOptions, get_backend

    backend = get_backend(option.backend)
    instance = backend.load(
        path, mc.ModelConfig(), BackendOptions(option.device, option.precision, providers=option.providers)
    )
    try:
        names = [t.name for t in instance.io.outputs]
        return [[np.asarray(instance.infer(feed)[n]) for n in names] for feed in feeds], None
    finally:
        instance.close()


def _backend_specs(path: Path, option: PlanOption) -> list[tuple[str, np.dtype[Any], list[int]]]:
    from edgeserve.backends.base import get_backend
    from edgeserve.protocol.datatypes import numpy_dtype

    io = get_backend(option.backend).inspect(path)
    return [(t.name, numpy_dtype(t.datatype), list(t.shape)) for t in io.inputs]


def _runtime_version(backend: str) -> str:
    dist = {"openvino": "openvino", "tensorrt": "tensorrt", "onnxruntime": "onnxruntime"}.get(
        backend, backend
    )
    for name in (dist, f"{dist}-gpu", f"{dist}-cu12"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{backend} ?"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "cpu part")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu ?"


class AccuracyGuard:
    """Callable as plan.AccuracyGuard: (artifact, option, tolerance) -> GuardResult, cached on disk."""

    def __init__(self, cache_dir: Path | None, samples: int = 3, seed: int = 0) -> None:
        self.cache = DigestCache(cache_dir, "accuracy", "the accuracy check", log)
        self.samples = samples
        self.seed = seed

    def measure(
        self,
        path: Path,
        option: PlanOption,
        runner: Runner | None = None,
        inputs: ModelInputs | None = None,
    ) -> tuple[list[fidelity.OutputFigures], str | None]:
        """(figures per output vs fp32, note); raises when the model cannot be run."""
        if option.backend == "openvino":
            specs, run = _openvino_specs(path), runner or _openvino_runner
        else:
            specs, run = _backend_specs(path, option), runner or _backend_runner
        feeds = inputs.feeds if inputs is not None else sample_feeds(specs, self.samples, self.seed)
        reference, _ = run(path, PlanOption(option.backend, option.device, "fp32", option.providers), feeds)
        candidate, note = run(path, option, feeds)
        names = _output_names(path, option, len(reference[0]) if reference else 0)
        figures = [
            fidelity.compare(name, [r[i] for r in reference], [c[i] for c in candidate])
            for i, name in enumerate(names)
        ]
        return figures, note

    def __call__(
        self, path: Path, option: PlanOption, tolerance: float, inputs: ModelInputs | None = None
    ) -> GuardResult:
        try:
            digest = model_digest(path)
        except OSError as exc:
            return GuardResult(False, f"cannot read {path.name}: {exc}")
        source = inputs.source if inputs is not None else f"{self.samples} random inputs"
        key = "|".join(
            (
                option.backend,
                option.device,
                option.precision,
                ",".join(option.providers),
                _runtime_version(option.backend),
                _cpu_model(),
                inputs.digest() if inputs is not None else f"{self.samples}x{self.seed}",
                "figures v3",  # entries of the old max-relative-error guard are not reused
            )
        )
        entries = self.cache.load(digest)
        cached = entries.get(key)
        figures: list[fidelity.OutputFigures] | None = None
        if isinstance(cached, dict) and isinstance(cached.get("figures"), list):
            try:
                figures, note, how = fidelity.from_dicts(cached["figures"]), cached.get("note"), "cached"
            except (TypeError, ValueError, AttributeError):
                figures = None  # an entry of another shape: measure again
        if figures is None:
            try:
                figures, note = self.measure(path, option, inputs=inputs)
            except Exception as exc:  # the guard must never take a load down: refuse the precision instead
                log.warning("accuracy check of %s for %s failed: %s", path, option.label(), exc)
                return GuardResult(False, f"could not run the check ({type(exc).__name__}: {exc})")
            entries[key] = {"figures": [f.to_dict() for f in figures], "note": note, "model": path.name}
            self.cache.store(digest, entries)
            how = f"measured on {source}"
        error = max((f.range_error for f in figures), default=0.0)
        if note:
            return GuardResult(False, f"{note}: nothing to gain ({how})", error, tuple(figures), source)
        ok, why = fidelity.judge(figures, tolerance)
        verdict = "within" if ok else "outside"
        return GuardResult(
            ok, f"{why} {verdict} tolerance {tolerance:g} ({how})", error, tuple(figures), source
        )


def _output_names(path: Path, option: PlanOption, count: int) -> list[str]:
    """Output names in run order (the runners return outputs in the model's order)."""
    try:
        if option.backend == "openvino":
            from edgeserve.backends.openvino import core as openvino_core

            model = openvino_core().read_model(str(path))
            names: list[str] = []
            for i, port in enumerate(model.outputs):
                try:
                    names.append(str(port.get_any_name()))
                except RuntimeError:
                    names.append(f"output{i}")
        else:
            from edgeserve.backends.base import get_backend

            names = [t.name for t in get_backend(option.backend).inspect(path).outputs]
    except Exception:
        names = []
    return names if len(names) == count else [f"output{i}" for i in range(count)]


def default_cache_dir(settings: Any) -> Path | None:
    """runtime.cache_dir, else <state_dir>/cache, else ~/.cache/edgeserve; None when none is writable."""
    candidates = [
        settings.runtime.cache_dir,
        settings.server.state_dir / "cache",
        Path.home() / ".cache" / "edgeserve",
    ]
    for folder in candidates:
        if folder is None:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return Path(folder)
    return None
