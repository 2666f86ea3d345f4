"""An ensemble's `ensemble_scheduling` (Triton's syntax) -> a validated DAG of steps (`EnsemblePlan`).

Checked at load, each error naming the file, the field and the fix: a step model that is not in the
repository, the ensemble naming itself, map keys that are not the step model's inputs/outputs, a
step input left unmapped, a tensor consumed but never produced, a tensor produced twice, a cycle, an
ensemble output never produced, and data types that disagree between producer and consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from edgeserve.protocol.errors import RepositoryError, Status
from edgeserve.protocol.model_config import type_name

ENSEMBLE_PLATFORM = "ensemble"

# (model name, version "" = latest) -> that model's (completed) config, or None when unknown.
ConfigLookup = Callable[[str, str], Any]


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    model_name: str
    model_version: str  # "" = the latest ready version (Triton's -1)
    inputs: dict[str, str]  # step model input -> ensemble tensor
    outputs: dict[str, str]  # step model output -> ensemble tensor

    @property
    def label(self) -> str:
        return f"step {self.index} '{self.model_name}'"


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]  # the ensemble's own inputs
    outputs: tuple[str, ...]  # the ensemble's own outputs
    order: tuple[int, ...]  # step indices in a topological order
    # ensemble tensor -> indices of the steps that read it
    consumers: dict[str, tuple[int, ...]]
    optional: frozenset[str] = frozenset()  # ensemble inputs a request may leave out

    @property
    def composing(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(step.model_name for step in self.steps))

    def needed(self, outputs: Iterable[str]) -> tuple[frozenset[int], frozenset[str]]:
        """The steps that the ensemble outputs `outputs` need (walking the DAG back from them: a
        step is needed when a needed step or `outputs` reads what it produces) and the tensors those
        steps read or `outputs` name. A step whose outputs nobody reads is not needed."""
        tensors = set(outputs)
        steps: set[int] = set()
        for index in reversed(self.order):  # every reader of a step's outputs comes before it
            step = self.steps[index]
            if any(tensor in tensors for tensor in step.outputs.values()):
                steps.add(index)
                tensors.update(step.inputs.values())
        return frozenset(steps), frozenset(tensors)


def is_ensemble(config: Any) -> bool:
    return bool(config.platform == ENSEMBLE_PLATFORM or config.HasField("ensemble_scheduling"))


def composing_models(config: Any) -> list[str]:
    """The step models named by an ensemble config, in order, each once (no validation)."""
    return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name))


def check_shape(config: Any, where: str) -> None:
    """What config.py checks for an ensemble before anything is loaded (no step models needed)."""
    if config.platform != ENSEMBLE_PLATFORM:
        raise RepositoryError(where, "platform", f"'{config.platform or config.backend}': a config with "
                              'ensemble_scheduling must have platform: "ensemble"')  # fmt: skip
    if not config.HasField("ensemble_scheduling"):
        raise RepositoryError(where, "ensemble_scheduling", 'platform "ensemble" needs an '
                              "ensemble_scheduling { step [ ... ] } block")  # fmt: skip
    if not config.ensemble_scheduling.step:
        raise RepositoryError(where, "ensemble_scheduling.step", "an ensemble needs at least one step")
    if config.instance_group:
        raise RepositoryError(where, "instance_group", "an ensemble has no instances of its own (its steps "
                              "run on their models' instances); remove instance_group")  # fmt: skip
    if config.model_warmup:
        raise RepositoryError(where, "model_warmup", "an ensemble is not warmed up (its step models are); "
                              "remove model_warmup")  # fmt: skip


def build_plan(config: Any, where: str, name: str, lookup: ConfigLookup) -> EnsemblePlan:
    """Validate `config`'s ensemble_scheduling against its step models' configs; the plan to run."""
    check_shape(config, where)

    def fail(field: str, problem: str, status: Status = Status.INVALID_ARG) -> None:
        raise RepositoryError(where, field, problem, status)

    dtypes: dict[str, tuple[int, str]] = {}  # tensor -> (data type, who decided it)
    producer: dict[str, str] = {}  # tensor -> who produces it
    for tensor in config.input:
        producer[tensor.name] = f"ensemble input '{tensor.name}'"
        dtypes[tensor.name] = (int(tensor.data_type), f"ensemble input '{tensor.name}'")
    steps: list[Step] = []
    for index, raw in enumerate(config.ensemble_scheduling.step):
        field = f"ensemble_scheduling.step[{index}]"
        model = raw.model_name
        if not model:
            fail(f"{field}.model_name", "must name the model this step runs")
        if model == name:
            fail(f"{field}.model_name", f"'{model}' is this ensemble itself; a step must run another model")
        version = "" if raw.model_version in (-1, 0) else str(raw.model_version)
        if raw.model_version < -1:
            fail(f"{field}.model_version", f"{raw.model_version}: use -1 (latest) or a version number >= 1")
        step_config = lookup(model, version)
        if step_config is None:
            which = f"version {version} of " if version else ""
            fail(f"{field}.model_name", f"{which}step model '{model}' is not in the model repository; add "
                 f"its folder or correct the name", Status.NOT_FOUND)  # fmt: skip
        if not raw.input_map:
            fail(f"{field}.input_map", f"step '{model}' maps no inputs")
        if not raw.output_map:
            fail(f"{field}.output_map", f"step '{model}' maps no outputs")
        step_inputs = {t.name: t for t in step_config.input}
        step_outputs = {t.name: t for t in step_config.output}
        for key in raw.input_map:
            if key not in step_inputs:
                names = ", ".join(step_inputs) or "(none)"
                fail(f"{field}.input_map['{key}']", f"'{key}' is not an input of model '{model}'; its "
                     f"inputs: {names}")  # fmt: skip
        unmapped = [n for n, t in step_inputs.items() if n not in raw.input_map and not t.optional]
        if unmapped:
            fail(f"{field}.input_map", f"input(s) {', '.join(unmapped)} of model '{model}' are not mapped to "
                 "an ensemble tensor")  # fmt: skip
        for key, tensor in raw.output_map.items():
            if key not in step_outputs:
                fail(f"{field}.output_map['{key}']", f"'{key}' is not an output of model '{model}'; its "
                     f"outputs: {', '.join(step_outputs) or '(none)'}")  # fmt: skip
            if tensor in producer:
                fail(f"{field}.output_map['{key}']", f"tensor '{tensor}' is already produced by "
                     f"{producer[tensor]}; give it another name")  # fmt: skip
            producer[tensor] = f"step {index} '{model}' output '{key}'"
            dtypes[tensor] = (int(step_outputs[key].data_type), producer[tensor])
        steps.append(Step(index, model, version, dict(raw.input_map), dict(raw.output_map)))

    consumers: dict[str, list[int]] = {}
    for step in steps:
        field = f"ensemble_scheduling.step[{step.index}]"
        step_inputs = {t.name: t for t in lookup(step.model_name, step.model_version).input}
        for key, tensor in step.inputs.items():
            if tensor not in producer:
                fail(f"{field}.input_map['{key}']", f"tensor '{tensor}' is consumed but never produced "
                     "(not an ensemble input nor any step's output_map value)")  # fmt: skip
            want = int(step_inputs[key].data_type)
            have, source = dtypes[tensor]
            if have != want:
                fail(f"{field}.input_map['{key}']", f"data type mismatch: '{tensor}' is {type_name(have)} "
                     f"({source}) but input '{key}' of model '{step.model_name}' is "
                     f"{type_name(want)}")  # fmt: skip
            consumers.setdefault(tensor, []).append(step.index)
    for tensor in config.output:
        if tensor.name not in producer:
            fail(f"output '{tensor.name}'", "the ensemble output is never produced: map a step output "
                 f"to '{tensor.name}' in an output_map")  # fmt: skip
        have, source = dtypes[tensor.name]
        if have != int(tensor.data_type):
            fail(f"output '{tensor.name}'.data_type", f"{type_name(tensor.data_type)} but {source} is "
                 f"{type_name(have)}")  # fmt: skip
    order = _topological(steps, producer, where)
    return EnsemblePlan(
        name=name,
        steps=tuple(steps),
        inputs=tuple(t.name for t in config.input),
        outputs=tuple(t.name for t in config.output),
        order=order,
        consumers={k: tuple(v) for k, v in consumers.items()},
        optional=frozenset(t.name for t in config.input if t.optional),
    )


def _topological(steps: list[Step], producer: dict[str, str], where: str) -> tuple[int, ...]:
    """Kahn's algorithm over step -> step edges (a tensor one writes and another reads)."""
    made_by: dict[str, int] = {}
    for step in steps:
        for tensor in step.outputs.values():
            made_by[tensor] = step.index
    needs: dict[int, set[int]] = {
        s.index: {made_by[t] for t in s.inputs.values() if t in made_by} for s in steps
    }
    order: list[int] = []
    ready = [s.index for s in steps if not needs[s.index]]
    while ready:
        current = ready.pop(0)
        order.append(current)
        for index, deps in needs.items():
            if current in deps:
                deps.discard(current)
                if not deps and index not in order and index not in ready:
                    ready.append(index)
    if len(order) != len(steps):
        stuck = [s for s in steps if s.index not in order]
        path = ", ".join(f"{s.label} needs {sorted(needs[s.index])}" for s in stuck)
        raise RepositoryError(where, "ensemble_scheduling.step", f"the steps form a cycle ({path}); an "
                              "ensemble must be a DAG: a step cannot consume what it or a later step "
                              "produces from it")  # fmt: skip
    return tuple(order)
