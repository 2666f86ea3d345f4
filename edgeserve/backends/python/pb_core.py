"""The core of pb_utils (inside the worker): tensors, responses, errors, the type maps, Logger.
pb_utils.py re-exports all of it; pb_bls.py builds on it."""

from __future__ import annotations

import functools
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

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the tensor's memory (CPU; no copy). BYTES tensors have no DLPack form."""
        if self._array.dtype == np.object_:
            raise TritonModelException("to_dlpack() is not supported for BYTES tensors")
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A Tensor over a DLPack object or capsule from another framework (CPU memory; no copy)."""
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        try:
            return Tensor(name, np.from_dlpack(source))
        except (TypeError, RuntimeError, BufferError) as exc:
            raise TritonModelException(f"from_dlpack: {exc} (edgeserve's tensors are CPU tensors)") from None

    @staticmethod
    def from_numpy(name: str, array: Any) -> Tensor:
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class _Capsule:
    """A bare DLPack capsule (as torch.utils.dlpack.to_dlpack makes) for numpy.from_dlpack."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class InferenceResponse:
    def __init__(
        self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None,
        parameters: str | dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = parameters

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: Any, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


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
