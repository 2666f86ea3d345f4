"""Fill a missing or partial model config from the model file (Triton's auto-complete).

- platform / backend, name, default_model_filename;
- max_batch_size: when the config declares no tensors and the first axis of every model input and
  output is dynamic, `default_max_batch_size` (4, as Triton); the batch axis then leaves `dims`;
- inputs (all of them; a declared one must agree with the model) and outputs (all, unless the config
  lists a subset), with data types and dims;
- dynamic_batching when max_batch_size > 1 and no scheduler is configured, with
  `preferred_batch_size` (the load-time race's measured batch size) where it set max_batch_size itself;
- instance_group (one instance, see `DEFAULT_INSTANCE_COUNT`) and version_policy latest{1}.
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends.base import ModelIO, TensorSpec
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.config import type_name
from edgeserve.scheduling.sequence_config import server_inputs

# One instance per model on this appliance. Triton defaults to 2 for ONNX Runtime on CPU; on a
# small box two instances each get half the cores and double the memory, and one instance using
# every core gives lower latency for the same throughput. Configs may still ask for more.
DEFAULT_INSTANCE_COUNT = 1


def config_type(datatype: str) -> int:
    """Protocol datatype ("FP32") -> model_config DataType enum value."""
    return int(mc.DataType.Value(datatypes.protocol_to_config(datatype)))


def can_batch(io: ModelIO) -> bool:
    """Triton's rule: every input and output has a dynamic first axis."""
    tensors = (*io.inputs, *io.outputs)
    return bool(tensors) and all(len(t.shape) >= 1 and t.shape[0] == -1 for t in tensors)


def _fmt(dims: Any) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]"


def _merge(where: str, kind: str, declared: Any, spec: TensorSpec, batch_axis: int, model_file: str) -> None:
    label = f"{kind} '{spec.name}'"
    model_type = config_type(spec.datatype)
    if declared.data_type == mc.TYPE_INVALID:
        declared.data_type = model_type
    elif declared.data_type != model_type:
        raise RepositoryError(where, f"{label}.data_type", f"{type_name(declared.data_type)} does not match "
                              f"{model_file}, which has {type_name(model_type)}")  # fmt: skip
    model_dims = list(spec.shape[batch_axis:])
    if not declared.dims and not declared.HasField("reshape"):
        declared.dims.extend(model_dims)
        return
    checked = list(declared.reshape.shape) if declared.HasField("reshape") else list(declared.dims)
    field = f"{label}.reshape.shape" if declared.HasField("reshape") else f"{label}.dims"
    fits = len(checked) == len(model_dims) and all(
        m == -1 or c == -1 or m == c for c, m in zip(checked, model_dims, strict=True)
    )
    if not fits:
        note = " (the first axis is the batch axis, since max_batch_size > 0)" if batch_axis else ""
        raise RepositoryError(where, field, f"{_fmt(checked)} does not match {model_file}, which has "
                              f"{_fmt(model_dims)}{note}")  # fmt: skip


def complete(
    config: Any,
    io: ModelIO,
    *,
    model_name: str,
    backend_name: str,
    platform: str,
    model_file: str,
    default_max_batch_size: int,
    gpu: bool = False,
    where: str = "config.pbtxt",
    preferred_batch_size: int = 0,
) -> Any:
    """A completed copy of `config` (the argument is not changed)."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    if not out.name:
        out.name = model_name
    if not out.backend:
        out.backend = backend_name
    if not out.platform and platform:
        out.platform = platform
    if not out.default_model_filename:
        out.default_model_filename = model_file

    declared_any = bool(out.input) or bool(out.output)
    batchable = can_batch(io)
    chose = out.max_batch_size == 0 and not declared_any and batchable
    if chose:
        out.max_batch_size = max(0, default_max_batch_size)
    if out.max_batch_size > 0 and not batchable:
        fixed = next(t for t in (*io.inputs, *io.outputs) if not t.shape or t.shape[0] != -1)
        raise RepositoryError(
            where, "max_batch_size",
            f"{out.max_batch_size} needs a dynamic first axis on every tensor, but {model_file} has "
            f"'{fixed.name}' with shape {_fmt(fixed.shape)}; set max_batch_size: 0 and list full dims",
        )  # fmt: skip
    batch_axis = 1 if out.max_batch_size > 0 else 0

    model_inputs = {t.name: t for t in io.inputs}
    model_outputs = {t.name: t for t in io.outputs}
    for kind, declared_list, model_tensors in (
        ("input", out.input, model_inputs),
        ("output", out.output, model_outputs),
    ):
        for declared in declared_list:
            spec = model_tensors.get(declared.name)
            if spec is None:
                raise RepositoryError(
                    where, f"{kind} '{declared.name}'",
                    f"{model_file} has no {kind} of that name; its {kind}s: {', '.join(model_tensors)}",
                )  # fmt: skip
            _merge(where, kind, declared, spec, batch_axis, model_file)
    # Every model input must be fed: add the undeclared ones. Outputs: a declared subset is allowed.
    declared_inputs = {t.name for t in out.input} | server_inputs(out)  # sequence controls and state
    for spec in io.inputs:
        if spec.name not in declared_inputs:
            tensor = out.input.add(name=spec.name, data_type=config_type(spec.datatype))
            tensor.dims.extend(spec.shape[batch_axis:])
    if not out.output:
        for spec in io.outputs:
            tensor = out.output.add(name=spec.name, data_type=config_type(spec.datatype))
            tensor.dims.extend(spec.shape[batch_axis:])

    if out.max_batch_size > 1 and out.WhichOneof("scheduling_choice") is None:
        out.dynamic_batching.SetInParent()
    wanted = chose and 0 < preferred_batch_size <= out.max_batch_size
    if wanted and out.HasField("dynamic_batching") and not out.dynamic_batching.preferred_batch_size:
        out.dynamic_batching.preferred_batch_size.append(preferred_batch_size)
    if not out.instance_group:
        kind = mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU
        out.instance_group.add(count=DEFAULT_INSTANCE_COUNT, kind=kind)
    for index, group in enumerate(out.instance_group):
        if not group.name:
            group.name = f"{out.name}_{index}"
        if group.count == 0:
            group.count = DEFAULT_INSTANCE_COUNT
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1
    return out


def instance_count(config: Any) -> int:
    return sum(max(int(g.count), 1) for g in config.instance_group) or DEFAULT_INSTANCE_COUNT
