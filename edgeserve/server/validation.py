"""Checks a request against the model config before it reaches a scheduler."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import invalid_arg
from edgeserve.protocol.inference import InferRequest

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig


@functools.lru_cache(maxsize=64)
def config_datatype(data_type: int) -> str:
    """TYPE_* enum value -> protocol datatype (cached: it is on every request's path)."""
    from tritonclient.grpc import model_config_pb2

    return datatypes.config_to_protocol(model_config_pb2.DataType.Name(data_type))


def _dims_match(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


class _Typed:
    __slots__ = ("datatype", "dtype")

    def __init__(self, spec: Any) -> None:
        self.datatype = config_datatype(spec.data_type)
        self.dtype = None if self.datatype == "BYTES" else datatypes.numpy_dtype(self.datatype)


class _InputSpec(_Typed):
    __slots__ = ("dims", "optional", "reshape")

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.dims = tuple(int(d) for d in spec.dims)
        self.reshape = tuple(int(d) for d in spec.reshape.shape) if spec.HasField("reshape") else None
        self.optional = bool(spec.optional)


class OutputSpec(_Typed):
    __slots__ = ("label_filename",)

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.label_filename = str(spec.label_filename)


class Compiled:
    """What a request is checked against, read out of the protobuf once per config (field access
    on a protobuf message costs about a microsecond each; this is on every request's path)."""

    __slots__ = ("config", "inputs", "max_batch", "output_specs", "outputs")

    def __init__(self, config: ModelConfig) -> None:
        self.config = config  # keeps the id() of the cache key from being reused
        self.inputs = {inp.name: _InputSpec(inp) for inp in config.input}
        self.max_batch = int(config.max_batch_size)
        self.outputs = [out.name for out in config.output]
        self.output_specs = {out.name: OutputSpec(out) for out in config.output}


_CACHE: dict[int, Compiled] = {}
_CACHE_MAX = 256


def compiled(config: ModelConfig) -> Compiled:
    """Served configs are never modified once loaded, so a compiled view stays valid."""
    entry = _CACHE.get(id(config))
    if entry is None or entry.config is not config:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        entry = _CACHE[id(config)] = Compiled(config)
    return entry


def validated_inputs(
    request: InferRequest, config: ModelConfig, model_label: str
) -> tuple[dict[str, npt.NDArray[Any]], int]:
    """The request's inputs keyed by name, and its batch size (1 for non-batching models).

    Every message names the model, the tensor and what was expected.
    """
    spec_of = compiled(config)
    expected = spec_of.inputs
    max_batch = spec_of.max_batch
    arrays: dict[str, npt.NDArray[Any]] = {}
    batch_size: int | None = None
    for tensor in request.inputs:
        spec = expected.get(tensor.name)
        if spec is None:
            raise invalid_arg(
                f"unexpected inference input '{tensor.name}' for model '{model_label}'; "
                f"model inputs: {', '.join(expected) or '(none)'}"
            )
        if tensor.name in arrays:
            raise invalid_arg(f"input '{tensor.name}' appears more than once in the request")
        want_type = spec.datatype
        if tensor.datatype != want_type:
            raise invalid_arg(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                f"'{model_label}' expects '{want_type}'"
            )
        if tensor.data is None:
            raise invalid_arg(f"input '{tensor.name}' has no data")
        shape = tuple(int(d) for d in tensor.shape)
        config_dims = spec.dims
        if max_batch > 0:
            if not shape:
                raise invalid_arg(
                    f"input '{tensor.name}' of model '{model_label}' needs a batch dimension; "
                    f"expected shape [-1,{','.join(map(str, config_dims))}]"
                )
            this_batch = shape[0]
            if this_batch < 1 or this_batch > max_batch:
                raise invalid_arg(
                    f"inference request batch-size must be <= {max_batch} (and >= 1) for '{model_label}', "
                    f"got {this_batch} in input '{tensor.name}'"
                )
            if batch_size is not None and this_batch != batch_size:
                raise invalid_arg(
                    f"input '{tensor.name}' has batch size {this_batch}, other inputs have {batch_size}"
                )
            batch_size = this_batch
            if not _dims_match(shape[1:], config_dims):
                raise invalid_arg(
                    f"unexpected shape for input '{tensor.name}' for model '{model_label}'. Expected "
                    f"[-1,{','.join(map(str, config_dims))}], got {list(shape)}"
                )
        elif not _dims_match(shape, config_dims):
            raise invalid_arg(
                f"unexpected shape for input '{tensor.name}' for model '{model_label}'. Expected "
                f"{list(config_dims)}, got {list(shape)}"
            )
        data = tensor.data
        if data.shape != shape:
            data = data.reshape(shape)
        if spec.reshape is not None:
            target = ((shape[0],) if max_batch > 0 else ()) + spec.reshape
            if -1 not in target and datatypes.element_count(target) != data.size:
                raise invalid_arg(f"input '{tensor.name}' cannot be reshaped to {list(target)}")
            data = data.reshape(target)
        if spec.dtype is not None and data.dtype != spec.dtype:
            data = data.view(spec.dtype)
        arrays[tensor.name] = data
    if len(arrays) != len(expected):
        missing = [name for name, spec in expected.items() if name not in arrays and not spec.optional]
        if missing:
            raise invalid_arg(
                f"expected {len(expected)} inputs but got {len(arrays)} inputs for model '{model_label}'. "
                f"Missing: {', '.join(missing)}"
            )
    return arrays, batch_size if batch_size is not None else 1


def requested_output_names(request: InferRequest, config: ModelConfig, model_label: str) -> list[str]:
    names = compiled(config).outputs
    if not request.outputs:
        return list(names)
    chosen: list[str] = []
    for out in request.outputs:
        if out.name not in names:
            raise invalid_arg(
                f"unexpected inference output '{out.name}' for model '{model_label}'; "
                f"model outputs: {', '.join(names)}"
            )
        if out.name in chosen:
            raise invalid_arg(f"output '{out.name}' requested more than once")
        if out.shm is not None and out.classification:
            raise invalid_arg(f"output '{out.name}': shared memory cannot be combined with classification")
        if out.classification and compiled(config).output_specs[out.name].datatype == "BYTES":
            raise invalid_arg(
                f"output '{out.name}' of model '{model_label}' is BYTES; classification needs numbers"
            )
        chosen.append(out.name)
    return chosen


def classify(
    array: npt.NDArray[Any], top_n: int, labels: list[str] | None, batched: bool
) -> npt.NDArray[Any]:
    """Triton's classification extension: top-N "value:index[:label]" strings per batch row."""
    rows = array.reshape(array.shape[0], -1) if batched else array.reshape(1, -1)
    n = min(top_n, rows.shape[1])
    out = np.empty((rows.shape[0], n), dtype=np.object_)
    for r, row in enumerate(rows):
        order = np.argsort(-row.astype(np.float64), kind="stable")[:n]
        for c, idx in enumerate(order):
            text = f"{row[idx]:f}:{idx}" if np.issubdtype(row.dtype, np.floating) else f"{row[idx]}:{idx}"
            if labels is not None and idx < len(labels):
                text += f":{labels[idx]}"
            out[r, c] = text.encode()
    return out if batched else out.reshape(n)
