"""A model's config (`ModelConfig`, Triton's own generated class) and its validation.

Every error names the file, the field and what is wrong, e.g.
`models/foo/config.pbtxt: dynamic_batching.preferred_batch_size: 16 exceeds max_batch_size 8`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.protocol.errors import RepositoryError, Status

# Parsing lives in protocol/model_config.py (backends/ and server/ read configs too); importers keep
# using these names here.
from edgeserve.protocol.model_config import ModelConfig as ModelConfig
from edgeserve.protocol.model_config import parse_json as parse_json
from edgeserve.protocol.model_config import parse_override as parse_override
from edgeserve.protocol.model_config import parse_pbtxt as parse_pbtxt
from edgeserve.protocol.model_config import parse_text as parse_text
from edgeserve.protocol.model_config import to_json as to_json
from edgeserve.protocol.model_config import type_name as type_name
from edgeserve.repository.layout import WARMUP_DIR
from edgeserve.server.ensemble_graph import check_shape


def _dims_ok(dims: Iterable[int]) -> bool:
    return all(d == -1 or d >= 1 for d in dims)


def _count(dims: Iterable[int]) -> int | None:
    total = 1
    for d in dims:
        if d < 0:
            return None
        total *= d
    return total


class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, problem: str, status: Status = Status.INVALID_ARG) -> None:
        raise RepositoryError(self.where, field, problem, status)


def validate(config: Any, where: str, model_name: str, model_dir: Path | None = None) -> None:
    """Check a complete (auto-completed) config; raises RepositoryError on the first problem."""
    check = _Checker(where)
    if config.name and config.name != model_name:
        check.fail("name", f"'{config.name}' must match the model folder name '{model_name}'")
    if config.max_batch_size < 0:
        check.fail("max_batch_size", f"{config.max_batch_size} must be >= 0 (0 disables batching)")
    _check_tensors(check, config, model_dir)
    _check_scheduling(check, config)
    _check_instances(check, config)
    _check_version_policy(check, config)
    _check_warmup(check, config, model_dir)


def _check_tensors(check: _Checker, config: Any, model_dir: Path | None) -> None:
    if not config.input:
        check.fail("input", "the model has no inputs")
    if not config.output:
        check.fail("output", "the model has no outputs")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            label = f"{kind} '{tensor.name}'" if tensor.name else f"{kind}[{index}]"
            if not tensor.name:
                check.fail(f"{label}.name", "must not be empty")
            if tensor.name in seen:
                check.fail(label, f"the name '{tensor.name}' appears twice")
            seen.add(tensor.name)
            if tensor.data_type == mc.TYPE_INVALID:
                check.fail(f"{label}.data_type", "is missing (e.g. TYPE_FP32)")
            if not _dims_ok(tensor.dims):
                check.fail(f"{label}.dims", f"{list(tensor.dims)}: each dim must be >= 1, or -1 for variable")
            if tensor.HasField("reshape"):
                shape = list(tensor.reshape.shape)
                if not _dims_ok(shape):
                    check.fail(
                        f"{label}.reshape.shape", f"{shape}: each dim must be >= 1, or -1 for variable"
                    )
                a, b = _count(tensor.dims), _count(shape)
                if a is not None and b is not None and a != b:
                    check.fail(f"{label}.reshape.shape", f"{shape} holds {b} elements but dims "
                               f"{list(tensor.dims)} hold {a}")  # fmt: skip
            labels = getattr(tensor, "label_filename", "")  # outputs only
            if labels and model_dir is not None and not (model_dir / labels).is_file():
                check.fail(f"{label}.label_filename", f"'{tensor.label_filename}' not found in {model_dir}")


def _check_scheduling(check: _Checker, config: Any) -> None:
    choice = config.WhichOneof("scheduling_choice")
    if choice == "sequence_batching":
        from edgeserve.scheduling.sequence_config import check as check_sequence

        check_sequence(config, check.where)
        return
    if choice == "ensemble_scheduling" or config.platform == "ensemble":
        check_shape(config, check.where)  # its steps are checked when they load
    if choice != "dynamic_batching":
        return
    batching = config.dynamic_batching
    max_batch = config.max_batch_size
    for size in batching.preferred_batch_size:
        if size < 1:
            check.fail("dynamic_batching.preferred_batch_size", f"{size} must be >= 1")
        if max_batch == 0:
            check.fail("dynamic_batching.preferred_batch_size",
                       f"{size} needs batching, but max_batch_size is 0")  # fmt: skip
        if size > max_batch:
            check.fail("dynamic_batching.preferred_batch_size", f"{size} exceeds max_batch_size {max_batch}")
    levels = batching.priority_levels
    if levels == 0 and batching.default_priority_level != 0:
        check.fail("dynamic_batching.default_priority_level",
                   f"{batching.default_priority_level} is set but priority_levels is 0")  # fmt: skip
    if levels > 0 and not 1 <= batching.default_priority_level <= levels:
        level = batching.default_priority_level
        check.fail("dynamic_batching.default_priority_level",
                   f"{level} must be between 1 and priority_levels {levels}")  # fmt: skip
    for level in batching.priority_queue_policy:
        if not 1 <= level <= levels:
            check.fail("dynamic_batching.priority_queue_policy",
                       f"level {level} is outside 1..priority_levels ({levels})")  # fmt: skip


def _check_instances(check: _Checker, config: Any) -> None:
    for index, group in enumerate(config.instance_group):
        label = f"instance_group[{index}]"
        if group.count < 0:
            check.fail(f"{label}.count", f"{group.count} must be >= 1")
        if group.kind not in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_CPU,
                              mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_MODEL):  # fmt: skip
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            check.fail(f"{label}.kind", f"{kind} is not supported; use KIND_CPU, KIND_GPU or KIND_AUTO",
                       Status.UNSUPPORTED)  # fmt: skip
        if group.gpus and group.kind == mc.ModelInstanceGroup.KIND_CPU:
            check.fail(f"{label}.gpus", "is only valid with kind KIND_GPU")
        if any(g < 0 for g in group.gpus):
            check.fail(f"{label}.gpus", f"{list(group.gpus)}: GPU ids must be >= 0")


def _check_version_policy(check: _Checker, config: Any) -> None:
    if not config.HasField("version_policy"):
        return
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "latest" and policy.latest.num_versions < 1:
        check.fail("version_policy.latest.num_versions", f"{policy.latest.num_versions} must be >= 1")
    if which == "specific":
        versions = list(policy.specific.versions)
        if not versions:
            check.fail("version_policy.specific.versions", "must list at least one version")
        bad = [v for v in versions if v < 1]
        if bad:
            check.fail("version_policy.specific.versions", f"{bad}: versions are numbers >= 1")


def _check_warmup(check: _Checker, config: Any, model_dir: Path | None) -> None:
    inputs = {t.name: t for t in config.input}
    for index, warmup in enumerate(config.model_warmup):
        label = f"model_warmup[{index}]"
        if not warmup.name:
            check.fail(f"{label}.name", "must not be empty")
        if config.max_batch_size > 0 and warmup.batch_size > config.max_batch_size:
            check.fail(f"{label}.batch_size",
                       f"{warmup.batch_size} exceeds max_batch_size {config.max_batch_size}")  # fmt: skip
        for name, sample in warmup.inputs.items():
            field = f"{label}.inputs['{name}']"
            spec = inputs.get(name)
            if spec is None:
                check.fail(field, f"'{name}' is not a model input; inputs: {', '.join(inputs)}")
                continue
            if sample.data_type != spec.data_type:
                check.fail(f"{field}.data_type", f"{type_name(sample.data_type)} differs from the input's "
                           f"{type_name(spec.data_type)}")  # fmt: skip
            if not all(d >= 1 for d in sample.dims):
                check.fail(f"{field}.dims", f"{list(sample.dims)}: warm-up dims must be fixed sizes >= 1")
            if len(sample.dims) != len(spec.dims) or any(
                d != -1 and d != s for d, s in zip(spec.dims, sample.dims, strict=False)
            ):
                check.fail(
                    f"{field}.dims", f"{list(sample.dims)} does not fit the input's dims {list(spec.dims)}"
                )
            source = sample.WhichOneof("input_data_type")
            if source is None:
                check.fail(field, "set one of zero_data, random_data or input_data_file")
            folder = model_dir / WARMUP_DIR if model_dir is not None else None
            if (
                source == "input_data_file"
                and folder is not None
                and not (folder / sample.input_data_file).is_file()
            ):
                check.fail(f"{field}.input_data_file", f"'{sample.input_data_file}' not found in {folder}")
        missing = [n for n, spec in inputs.items() if n not in warmup.inputs and not spec.optional]
        if missing:
            check.fail(f"{label}.inputs", f"no warm-up data for input(s) {', '.join(missing)}")
