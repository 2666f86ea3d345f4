"""Model warm-up (Triton's `model_warmup`): run samples through every instance before the model is READY.

Each sample has a batch size, one tensor per input (zero_data, random_data, or input_data_file from
`<model>/warmup/`, in the wire layout: raw little-endian values, or length-prefixed BYTES) and a
count. A model with no `model_warmup` whose inputs all have fixed dims gets one zero-data run of
batch 1, so the first real request does not pay for lazy allocations; its failure is only logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.backends.base import Array, Instance
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.config import type_name
from edgeserve.repository.layout import WARMUP_DIR

log = logging.getLogger("edgeserve.repository")


@dataclass
class WarmupSample:
    name: str
    inputs: dict[str, Array]
    count: int = 1
    required: bool = True  # False for the implicit warm-up: a failure is logged, not fatal


def _datatype(data_type: int) -> str:
    return datatypes.config_to_protocol(type_name(data_type))


def _random(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> Array:
    if datatype == "BYTES":
        out = np.empty(shape, dtype=np.object_)
        flat = out.reshape(-1)
        for i in range(flat.size):
            flat[i] = bytes(rng.integers(97, 123, size=int(rng.integers(1, 9)), dtype=np.uint8))
        return out
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    dtype = datatypes.numpy_dtype(datatype)
    if datatype in ("FP16", "FP32", "FP64", "BF16"):
        return rng.random(size=shape, dtype=np.float32).astype(dtype)
    return rng.integers(0, 10, size=shape).astype(dtype)


def _zeros(datatype: str, shape: tuple[int, ...]) -> Array:
    if datatype == "BYTES":
        out = np.empty(shape, dtype=np.object_)
        out.reshape(-1)[:] = [b""] * out.size
        return out
    return np.zeros(shape, dtype=datatypes.numpy_dtype(datatype))


def _from_file(path: Path, datatype: str, shape: tuple[int, ...], where: str, field: str) -> Array:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RepositoryError(where, field, f"cannot read {path}: {exc}") from None
    try:
        if datatype == "BYTES":
            array: Array = datatypes.deserialize_bytes(data, datatypes.element_count(shape), str(path))
        else:
            array = datatypes.from_buffer(data, datatype, shape, str(path)).copy()
        return array.reshape(shape)
    except Exception as exc:
        message = getattr(exc, "message", str(exc))
        raise RepositoryError(
            where, field, f"{path.name} does not hold {datatype} {list(shape)}: {message}"
        ) from None


def samples(config: Any, model_dir: Path, where: str, seed: int = 0) -> list[WarmupSample]:
    """The warm-up samples of a validated, complete config (the implicit one when none is configured)."""
    rng = np.random.default_rng(seed)
    batching = config.max_batch_size > 0
    specs = {t.name: t for t in config.input}
    out: list[WarmupSample] = []
    for index, warmup in enumerate(config.model_warmup):
        batch = max(int(warmup.batch_size), 1)
        arrays: dict[str, Array] = {}
        for name, sample in warmup.inputs.items():
            field = f"model_warmup[{index}].inputs['{name}']"
            datatype = _datatype(sample.data_type)
            dims = tuple(int(d) for d in sample.dims)
            shape = ((batch,) if batching else ()) + dims
            source = sample.WhichOneof("input_data_type")
            if source == "random_data":
                array = _random(datatype, shape, rng)
            elif source == "input_data_file":
                path = model_dir / WARMUP_DIR / sample.input_data_file
                array = _from_file(path, datatype, shape, where, f"{field}.input_data_file")
            else:
                array = _zeros(datatype, shape)
            arrays[name] = _reshaped(array, specs[name], batching)
        out.append(WarmupSample(warmup.name, arrays, max(int(warmup.count), 1)))
    if not out:
        implicit = implicit_sample(config)
        if implicit is not None:
            out.append(implicit)
    if config.WhichOneof("scheduling_choice") == "sequence_batching":  # + control inputs and state
        from edgeserve.scheduling.sequence_config import warmup_inputs

        for sample in out:
            sample.inputs = warmup_inputs(config, sample.inputs)
    return out


def _reshaped(array: Array, spec: Any, batching: bool) -> Array:
    if not spec.HasField("reshape"):
        return array
    target = ((array.shape[0],) if batching else ()) + tuple(int(d) for d in spec.reshape.shape)
    return array.reshape(target)


def implicit_sample(config: Any) -> WarmupSample | None:
    if config.model_transaction_policy.decoupled:  # answers on a stream only: a unary call is refused
        return None
    if config.backend == "python":  # user code with effects (BLS calls, metrics, files): as Triton, only
        return None  # the config's model_warmup runs it before the first request
    batching = config.max_batch_size > 0
    arrays: dict[str, Array] = {}
    for spec in config.input:
        if any(d < 0 for d in spec.dims):
            return None
        shape = ((1,) if batching else ()) + tuple(int(d) for d in spec.dims)
        arrays[spec.name] = _reshaped(_zeros(_datatype(spec.data_type), shape), spec, batching)
    return WarmupSample("implicit zero-data warm-up", arrays, 1, required=False)


def run(instances: list[Instance], warmups: list[WarmupSample], label: str) -> None:
    """Run every sample `count` times on every instance; a required sample's failure raises."""
    for sample in warmups:
        for number, instance in enumerate(instances):
            for _ in range(sample.count):
                try:
                    instance.infer(sample.inputs)
                except Exception as exc:
                    message = getattr(exc, "message", str(exc))
                    if sample.required:
                        raise RepositoryError(label, f"model_warmup '{sample.name}'",
                                              f"failed on instance {number}: {message}") from exc  # fmt: skip
                    log.warning(
                        "%s: %s failed on instance %d (ignored): %s", label, sample.name, number, message
                    )
                    break
