"""The backend contract (DESIGN.md): load(model_path, config, options) -> Instance; Instance.infer.

A backend module exposes a module-level `BACKEND` object satisfying `Backend`. Modules are imported
lazily through `get_backend`, so a box without a runtime never pays for (or fails on) its import.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from edgeserve.backends.options import PINNED_PARAMETER as PINNED_PARAMETER
from edgeserve.backends.options import BackendOptions as BackendOptions
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # protocol datatype, e.g. "FP32"
    shape: tuple[int, ...]  # full runtime shape including any batch axis; -1 = dynamic


@dataclass(frozen=True, slots=True)
class ModelIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


# Triton's request flags (TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END).
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What an instance that takes a batch as separate requests (`infer_requests`: Python models,
    Triton's execute(requests)) learns about each one besides its tensors. A Direct sequence batch's
    empty slot is a null request: all defaults (correlation ID 0, no flags)."""

    request_id: str = ""
    correlation_id: int | str = 0
    flags: int = 0
    parameters: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Instance(Protocol):
    """One loaded copy of a model. `infer` is called one call at a time, but not always from the same
    thread: usually its worker, sometimes a frontend's thread (`Scheduler.try_run_inline`). So no
    thread-local state (a CUDA context must be the device's primary one, as the runtime API uses)."""

    io: ModelIO

    def infer(
        self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None
    ) -> dict[str, Array]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str  # the config `backend` value, e.g. "onnxruntime"
    platforms: tuple[str, ...]  # config `platform` values it serves, e.g. ("onnxruntime_onnx",)
    artifacts: tuple[str, ...]  # default model file names it reads, e.g. ("model.onnx",)

    def unavailable_reason(self) -> str | None:
        """None when the runtime imports and works here; otherwise why not (for plans and errors)."""

    def inspect(self, model_path: Path) -> ModelIO:
        """Inputs/outputs of a model file without keeping it loaded (config auto-complete)."""

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> Instance: ...


# name -> module holding BACKEND; the order is the default preference when nothing else decides.
BACKEND_MODULES: dict[str, str] = {
    "tensorrt": "edgeserve.backends.tensorrt",
    "openvino": "edgeserve.backends.openvino",
    "onnxruntime": "edgeserve.backends.onnxruntime",
    "neuron": "edgeserve.backends.neuron",
    "python": "edgeserve.backends.python",
}

# Triton `platform` strings -> our backend names
PLATFORM_BACKEND: dict[str, str] = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "openvino": "openvino",
    "pytorch_libtorch": "neuron",
}

_loaded: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend called `name`, importing its module on first use."""
    if name in _loaded:
        return _loaded[name]
    module_name = BACKEND_MODULES.get(name)
    if module_name is None:
        raise InferenceError(
            Status.INVALID_ARG,
            f"unknown backend '{name}'; edgeserve has: {', '.join(sorted(BACKEND_MODULES))}",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InferenceError(Status.UNAVAILABLE, f"backend '{name}' is not installed here: {exc}") from exc
    backend: Backend = module.BACKEND
    _loaded[name] = backend
    return backend


def ensure_contiguous(array: Array) -> Array:
    """Runtimes want C-contiguous input; copying here is the one copy on the way in, if any."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)
