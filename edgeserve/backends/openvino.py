"""OpenVINO backend: an IR (`model.xml` + `model.bin`) or an ONNX file, compiled for CPU / GPU / NPU / AUTO.

The precision is always stated: on CPUs with AMX (and some with AVX512-BF16) OpenVINO's default
inference precision is bf16, which silently changes results; `fp32` asks for "f32" explicitly.
`openvino` is imported only in here.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends import memory
from edgeserve.backends.base import (
    PINNED_PARAMETER,
    Array,
    BackendOptions,
    ModelIO,
    TensorSpec,
    ensure_contiguous,
)
from edgeserve.backends.openvino_cache import CompiledCache
from edgeserve.backends.openvino_memory import IdleRelease, weights_bytes
from edgeserve.protocol.datatypes import BF16_DTYPE
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger("edgeserve.backends.openvino")

# OpenVINO element type names -> protocol datatypes
OV_TYPES: dict[str, str] = {
    "f32": "FP32", "f16": "FP16", "bf16": "BF16", "f64": "FP64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64",
    "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "boolean": "BOOL", "string": "BYTES",
}  # fmt: skip

PRECISION_HINTS: dict[str, str] = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # "auto": runtime default
RUNTIME_CACHE = "CPU_RUNTIME_CACHE_CAPACITY"

_core: Any = None
_core_lock = threading.Lock()


def openvino_module() -> Any:
    """`import openvino`, once, with its usage telemetry blocked.

    An appliance must not phone home, and the telemetry forks a process from whichever loader thread
    imports openvino first, which has hung the server while other threads held locks.
    """
    with _core_lock:
        if "openvino" not in sys.modules:
            sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
        import openvino

        return openvino


def core() -> Any:
    """One process-wide ov.Core (it is thread safe and caches plugins)."""
    global _core
    ov = openvino_module()
    with _core_lock:
        if _core is None:
            _core = ov.Core()
            # pyopenvino builds its type -> numpy dtype table in a C++ function-local static on first
            # use, and that build can drop the GIL (numpy's C API import): two threads doing it at once
            # (two models planned or loaded in parallel) deadlock. Build it here, once, under the lock.
            ov.Type.f32.to_dtype()
            _ = ov.Tensor(np.zeros(1, dtype=np.float32)).data
        return _core


def ov_device(device: str) -> str:
    """Our device names ("GPU:1") -> OpenVINO's ("GPU.1")."""
    base, _, index = device.partition(":")
    return f"{base.upper()}.{index}" if index else base.upper()


def _tensor_name(port: Any, fallback: str) -> str:
    try:
        return str(port.get_any_name())
    except RuntimeError:  # a port without names (possible in hand-made IR)
        return fallback


def _spec(port: Any, name: str, path: Path) -> TensorSpec:
    type_name = port.get_element_type().get_type_name()
    datatype = OV_TYPES.get(type_name)
    if datatype is None:
        raise InferenceError(Status.INVALID_ARG, f"{path}: tensor '{name}' has element type {type_name}, "
                             "which edgeserve's openvino backend does not serve")  # fmt: skip
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        raise InferenceError(
            Status.INVALID_ARG,
            f"{path}: tensor '{name}' has a dynamic rank; give it a fixed rank (e.g. reshape the model) "
            "or declare its dims in config.pbtxt",
        )
    dims = tuple(-1 if d.is_dynamic else int(d.get_length()) for d in shape)
    return TensorSpec(name, datatype, dims)


def _model_io(model: Any, path: Path) -> ModelIO:
    inputs = tuple(_spec(p, _tensor_name(p, f"input{i}"), path) for i, p in enumerate(model.inputs))
    outputs = tuple(_spec(p, _tensor_name(p, f"output{i}"), path) for i, p in enumerate(model.outputs))
    return ModelIO(inputs, outputs)


def runtime_message(exc: BaseException) -> str:
    """OpenVINO's exception text without its "Exception from src/...cpp:NN:" source-location lines."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith("Exception from src/")]
    return " ".join(kept) or str(exc).strip()


def _read(path: Path) -> Any:
    try:
        return core().read_model(str(path))
    except Exception as exc:
        raise InferenceError(
            Status.INVALID_ARG, f"{path}: openvino cannot read the model: {runtime_message(exc)}"
        ) from exc


def compile_properties(
    options: BackendOptions, supported: set[str] | None, device: str = "CPU"
) -> dict[str, Any]:
    """The compile_model config for `options`; `supported` = the device's property names (None = all)."""
    props: dict[str, Any] = {"PERFORMANCE_HINT": options.performance_hint}
    hint = PRECISION_HINTS.get(options.precision)
    if hint is not None:
        props["INFERENCE_PRECISION_HINT"] = hint
    if options.threads > 0:
        props["INFERENCE_NUM_THREADS"] = options.threads
    # Upper-case model parameters are OpenVINO properties (as in Triton's openvino backend),
    # e.g. parameters { key: "NUM_STREAMS" value: { string_value: "1" } }.
    for key, value in options.parameters.items():
        if key.isupper() and key != "CACHE_DIR":
            props[key] = value
    if supported is not None:
        props = {k: v for k, v in props.items() if k in supported}
    if device.split(".")[0] == "CPU":
        # Not listed in SUPPORTED_PROPERTIES, but honoured: the per-shape cache of a dynamic-shape
        # model otherwise grows to 5000 entries (memory.py).
        cache = options.parameters.get(RUNTIME_CACHE, str(memory.current().ov_runtime_cache))
        props[RUNTIME_CACHE] = int(cache) if cache.strip().isdigit() else cache
    # No CACHE_DIR: openvino would load whatever blob lies there; edgeserve caches compiled models
    # itself, keyed and sealed (openvino_cache.py).
    return props


class OpenVinoInstance:
    """One compiled model with one infer request (infer is called from one thread at a time)."""

    def __init__(
        self, compiled: Any, io: ModelIO, path: Path, device: str, fallback_reason: str | None
    ) -> None:
        self._compiled: Any = compiled
        self._request: Any = compiled.create_infer_request()
        self._memory = IdleRelease(compiled, memory.current().ov_release_idle_s, self._renew)
        self.io = io
        self.path = path
        self.device = device
        self.fallback_reason = fallback_reason
        self._input_types = {t.name: t.datatype for t in io.inputs}
        self._output_names = [t.name for t in io.outputs]
        self._bf16_outputs = {t.name for t in io.outputs if t.datatype == "BF16"}
        self._weights: int | None = None

    def _renew(self) -> None:
        """A fresh infer request (`_memory.busy` held): the old one's tensors go with it."""
        if self._request is not None and self._compiled is not None:
            self._request = self._compiled.create_infer_request()

    def compiled_property(self, name: str) -> Any:
        """A property of the compiled model, e.g. INFERENCE_PRECISION_HINT (for checks and logs)."""
        if self._compiled is None:
            raise InferenceError(Status.UNAVAILABLE, f"{self.path}: the openvino model is closed")
        return self._compiled.get_property(name)

    def _feed(self, name: str, array: Array) -> Any:
        if self._input_types.get(name) == "BF16":
            ov = openvino_module()

            tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(array.shape)))
            tensor.data.view(np.uint16)[...] = ensure_contiguous(array).view(np.uint16)
            return tensor
        return ensure_contiguous(array)

    def infer(self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        feed = {name: self._feed(name, array) for name, array in inputs.items()}
        with self._memory.busy:
            request = self._request  # renewed while idle (openvino_memory.py)
            if request is None:
                raise InferenceError(Status.UNAVAILABLE, f"{self.path}: the openvino model is closed")
            try:
                # share_inputs: no copy in; outputs are copied out, since the request reuses its buffers.
                result = request.infer(feed, share_inputs=True, share_outputs=False)
            except Exception as exc:
                status = Status.INVALID_ARG if "shape" in str(exc).lower() else Status.INTERNAL
                message = f"openvino failed to run {self.path.name}: {runtime_message(exc)}"
                raise InferenceError(status, message) from exc
            finally:
                self._memory.after_call()
        values = list(result.values())
        wanted = set(outputs) if outputs else None
        out: dict[str, Array] = {}
        for name, value in zip(self._output_names, values, strict=True):
            if wanted is not None and name not in wanted:
                continue
            array = np.asarray(value)
            if name in self._bf16_outputs and BF16_DTYPE is not None:
                array = array.view(np.uint16).view(BF16_DTYPE)
            out[name] = array
        return out

    def memory_estimate(self) -> dict[str, int]:
        """What this instance holds, as far as OpenVINO tells: the compiled constants (`weights`)."""
        compiled = self._compiled
        if compiled is None:
            return {}
        if self._weights is None:
            self._weights = weights_bytes(compiled)
        return {"weights": self._weights}

    def close(self) -> None:
        self._request = None
        self._compiled = None
        self._memory.close()


class OpenVinoBackend:
    name = "openvino"
    platforms: tuple[str, ...] = ("openvino",)
    artifacts: tuple[str, ...] = ("model.xml", "model.onnx")

    def unavailable_reason(self) -> str | None:
        try:
            openvino_module()
        except ImportError as exc:
            return f"openvino is not installed: {exc}"
        return None

    def inspect(self, model_path: Path) -> ModelIO:
        return _model_io(_read(model_path), model_path)

    def _device(self, requested: str) -> tuple[str, str | None]:
        """The OpenVINO device to compile for, and why it is not the requested one (None if it is)."""
        device = ov_device(requested or "CPU")
        base = device.split(".")[0]
        if base in ("AUTO", "MULTI", "HETERO", "BATCH") or device == "CPU":
            # `available_devices` loads and initialises every plugin (GPU, NPU: ~35 MB on a box
            # without them); the CPU plugin is part of every openvino build.
            return device, None
        available = list(core().available_devices)
        if device in available or (device == base and any(d.split(".")[0] == base for d in available)):
            return device, None
        return "CPU", f"device {device} is not available to openvino here (available: {', '.join(available)})"

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> OpenVinoInstance:
        model = _read(model_path)
        io = _model_io(model, model_path)
        strings = [t.name for t in (*io.inputs, *io.outputs) if t.datatype == "BYTES"]
        if strings:
            # OpenVINO 2024-2026 corrupts the heap on string tensors (seen: free(): invalid pointer).
            raise InferenceError(
                Status.INVALID_ARG,
                f"{model_path}: string (BYTES) tensors {', '.join(strings)} are not served by the openvino "
                'backend; use backend: "onnxruntime"',
            )
        device, fallback = self._device(options.device)
        wide = [t.name for t in (*io.inputs, *io.outputs) if t.datatype in ("INT64", "UINT64")]
        if wide and device.startswith("CPU") and options.parameters.get(PINNED_PARAMETER) != self.name:
            # The CPU plugin computes 64-bit integers in 32 bits: 2**40 comes back as 0. Refusing lets
            # the plan fall back to a backend that keeps them; a config that names openvino accepts it.
            raise InferenceError(
                Status.UNSUPPORTED,
                f"{model_path}: INT64 tensors {', '.join(wide)} would be computed in 32 bits by openvino's "
                'CPU plugin; set backend: "openvino" in config.pbtxt to accept that',
            )
        if fallback:
            fallback += "; running on CPU"
            log.warning("%s: CPU fallback: %s", model_path, fallback)
        supported: set[str] | None = None
        if device.split(".")[0] in ("CPU", "GPU", "NPU"):
            try:
                supported = set(core().get_property(device, "SUPPORTED_PROPERTIES"))
            except Exception:  # older plugins: pass everything and let compile_model judge
                supported = None
        props = compile_properties(options, supported, device)
        try:
            if options.cache_dir is not None:
                cache = CompiledCache(options.cache_dir)
                compiled = cache.compile(openvino_module(), core(), model, model_path, device, props)
            else:
                compiled = core().compile_model(model, device, props)
        except Exception as exc:
            raise InferenceError(
                Status.INTERNAL,
                f"{model_path}: openvino cannot compile the model for {device}: {runtime_message(exc)}",
            ) from exc
        return OpenVinoInstance(compiled, io, model_path, device, fallback)


BACKEND = OpenVinoBackend()
