"""The part of Triton's `triton_python_backend_utils` that simple Python models use.

Inside a worker, `import triton_python_backend_utils as pb_utils` gives this module. Covered:
Tensor (name, as_numpy), InferenceRequest (inputs, get_input_tensor_by_name, requested output
names, parameters, request_id), InferenceResponse (output_tensors, error), TritonError (with its
status codes), TritonModelException, get_input_tensor_by_name / get_output_tensor_by_name,
get_input_config_by_name / get_output_config_by_name, triton_string_to_numpy and the type maps,
Logger, and the auto-complete `ModelConfig` (as_dict, add_input, add_output, set_max_batch_size,
max_batch_size, set_dynamic_batching, set_model_transaction_policy). Not covered: BLS
(InferenceRequest.exec), decoupled response senders, DLPack.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]

_TYPE_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}  # fmt: skip
# Triton's numeric TRITONSERVER_DataType values (triton_to_numpy_type / numpy_to_triton_type)
_TRITON_CODES: dict[int, Any] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}  # fmt: skip


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """'TYPE_FP32' -> numpy.float32; 'TYPE_STRING' -> numpy.object_."""
    return _TYPE_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _TRITON_CODES.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type in (np.object_, np.bytes_, np.str_, object, bytes, str):
        return 13
    for code, numpy_type in _TRITON_CODES.items():
        if np.dtype(numpy_type) == np.dtype(data_type):
            return code
    return None


class TritonError(Exception):
    """An error for one response: `InferenceResponse(error=TritonError("..."))`. The code is
    INTERNAL unless given (as Triton); edgeserve maps it to the request's status."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by the utilities on misuse; raising it in execute() fails the batch with its message."""


class Tensor:
    def __init__(self, name: str, data: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException("Tensor name must be a str")
        array = np.asarray(data)
        if array.dtype.kind in ("U", "S"):
            array = array.astype(np.object_)
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Array:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype.type)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class InferenceRequest:
    """One request as execute() sees it. Calling other models (BLS `exec`) is not supported."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        parameters: str | dict[str, Any] = "{}",
        model_name: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        **_: Any,
    ) -> None:
        self._correlation_id = correlation_id
        self._flags = flags
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._id = request_id
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)
        self._model_name = model_name

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return self._parameters

    def correlation_id(self) -> int | str:
        """The sequence's ID (0 outside a sequence and in a Direct batch's empty slot)."""
        return self._correlation_id

    def flags(self) -> int:
        """Triton's sequence flags: 1 = START, 2 = END (both on a one-request sequence)."""
        return self._flags

    def is_cancelled(self) -> bool:
        return False

    def exec(self, *_: Any, **__: Any) -> Any:
        raise TritonModelException("edgeserve's Python backend does not support BLS (InferenceRequest.exec)")

    async_exec = exec


class InferenceResponse:
    def __init__(self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _config_entry(model_config: Any, kind: str, name: str) -> dict[str, Any] | None:
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    for entry in model_config.get(kind, []) if isinstance(model_config, dict) else []:
        if entry.get("name") == name:
            return dict(entry)
    return None


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "output", name)


def _log(message: str, level: str = "INFO") -> None:
    print(f"[python model] {level}: {message}", file=sys.stderr, flush=True)


class Logger:
    """pb_utils.Logger: lines go to the server's log (the worker's stderr)."""

    INFO, WARNING, ERROR, VERBOSE = "INFO", "WARNING", "ERROR", "VERBOSE"
    log = staticmethod(_log)
    log_info = staticmethod(functools.partial(_log, level=INFO))
    log_warn = staticmethod(functools.partial(_log, level=WARNING))
    log_error = staticmethod(functools.partial(_log, level=ERROR))
    log_verbose = staticmethod(functools.partial(_log, level=VERBOSE))


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives and fills in."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        config.setdefault("input", [])
        config.setdefault("output", [])

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def max_batch_size(self) -> int:
        return int(self._config.get("max_batch_size", 0))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if int(max_batch_size) < 0:
            raise ValueError("max_batch_size must be >= 0")
        current = self.max_batch_size()
        if current > 0 and current != int(max_batch_size):
            raise ValueError(
                f"configuration specified max_batch_size {current}, but auto-complete-config "
                f"function for model '{self._config.get('name', '')}' specified {max_batch_size}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" in self._config:
            raise ValueError("the config sets sequence_batching; dynamic batching cannot be added")
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        if policy.get("decoupled"):
            raise ValueError("edgeserve's Python backend does not support decoupled models")
        self._config["model_transaction_policy"] = dict(policy)

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        if not isinstance(tensor, dict) or "name" not in tensor:
            raise ValueError(f"add_{kind} needs a dict with at least 'name'")
        for key in ("data_type", "dims"):
            if key not in tensor and kind == "input":
                raise ValueError(f"{kind} '{tensor['name']}' is missing '{key}'")
        new = {k: (list(v) if k == "dims" else v) for k, v in tensor.items()}
        for current in self._config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            for key, value in new.items():
                have = current.get(key)
                if have not in (None, [], "", "TYPE_INVALID") and have != value:
                    raise ValueError(
                        f"{kind} '{tensor['name']}': configuration specified {key} {have}, but "
                        f"auto-complete-config specified {value}"
                    )
                current[key] = value
            return
        self._config[kind].append(new)
