"""Load-time validation of ensemble_scheduling: each error names the file, the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.protocol.errors import RepositoryError, Status
from edgeserve.repository.config import validate
from edgeserve.server.ensemble_graph import build_plan, composing_models

MODELS = {
    "det": """input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
              output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]""",
    "two": """input [ { name: "a" data_type: TYPE_FP32 dims: [ -1 ] },
                     { name: "b" data_type: TYPE_FP32 dims: [ -1 ] } ]
              output [ { name: "c" data_type: TYPE_FP32 dims: [ -1 ] } ]""",
    "ints": """input [ { name: "i" data_type: TYPE_INT32 dims: [ -1 ] } ]
               output [ { name: "o" data_type: TYPE_INT32 dims: [ -1 ] } ]""",
}
WHERE = "models/ens/config.pbtxt"


def _config(steps: str, outputs: str = '{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }') -> Any:
    text = f"""name: "ens" platform: "ensemble"
      input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }} ]
      output [ {{outputs}} ]
      ensemble_scheduling {{ step [ {steps} ] }}""".replace("{outputs}", outputs)
    return text_format.Parse(text, mc.ModelConfig())


def _lookup(name: str, version: str) -> Any:
    if name not in MODELS or version not in ("", "1"):
        return None
    return text_format.Parse(f'name: "{name}" ' + MODELS[name], mc.ModelConfig())


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {ins} {outs} }}'


def _error(config: Any) -> RepositoryError:
    with pytest.raises(RepositoryError) as caught:
        build_plan(config, WHERE, "ens", _lookup)
    assert caught.value.message.startswith(WHERE + ": ")
    return caught.value


def test_a_valid_dag_and_its_order() -> None:
    config = _config(", ".join([
        _step("two", {"a": "t1", "b": "t2"}, {"c": "OUT"}),  # listed first, runs last
        _step("det", {"x": "IN"}, {"y": "t1"}),
        _step("det", {"x": "IN"}, {"y": "t2"}, version=1),
    ]))  # fmt: skip
    plan = build_plan(config, WHERE, "ens", _lookup)
    assert plan.order[-1] == 0 and set(plan.order[:2]) == {1, 2}
    assert plan.consumers == {"t1": (0,), "t2": (0,), "IN": (1, 2)}
    assert plan.composing == ("two", "det") and composing_models(config) == ["two", "det"]
    assert plan.steps[2].model_version == "1" and plan.steps[1].label == "step 1 'det'"


def test_the_steps_requested_outputs_need() -> None:
    # IN -> det(0) -> t1 -> det(1) -> A ; IN -> det(2) -> t2 ; (t1, t2) -> two(3) -> B ; IN -> det(4) -> C
    config = _config(", ".join([
        _step("det", {"x": "IN"}, {"y": "t1"}), _step("det", {"x": "t1"}, {"y": "A"}),
        _step("det", {"x": "IN"}, {"y": "t2"}), _step("two", {"a": "t1", "b": "t2"}, {"c": "B"}),
        _step("det", {"x": "IN"}, {"y": "C"}),
    ]), ", ".join(f'{{ name: "{n}" data_type: TYPE_FP32 dims: [ -1 ] }}' for n in "ABC"))  # fmt: skip
    plan = build_plan(config, WHERE, "ens", _lookup)
    assert plan.needed(["A"]) == (frozenset({0, 1}), frozenset({"A", "t1", "IN"}))
    assert plan.needed(["B"]) == (frozenset({0, 2, 3}), frozenset({"B", "t1", "t2", "IN"}))
    assert plan.needed(["C"])[0] == {4}
    assert plan.needed(["A", "B", "C"])[0] == {0, 1, 2, 3, 4}
    assert plan.needed([])[0] == set()


@pytest.mark.parametrize(
    ("steps", "outputs", "field", "words"),
    [
        ([_step("nope", {"x": "IN"}, {"y": "OUT"})], None, "ensemble_scheduling.step[0].model_name",
         "step model 'nope' is not in the model repository"),
        ([_step("det", {"x": "IN"}, {"y": "OUT"}, version=7)], None, "ensemble_scheduling.step[0].model_name",
         "version 7 of step model 'det'"),
        ([_step("ens", {"x": "IN"}, {"y": "OUT"})], None, "ensemble_scheduling.step[0].model_name",
         "is this ensemble itself"),
        ([_step("det", {"z": "IN"}, {"y": "OUT"})], None, "ensemble_scheduling.step[0].input_map['z']",
         "'z' is not an input of model 'det'; its inputs: x"),
        ([_step("two", {"a": "IN"}, {"c": "OUT"})], None, "ensemble_scheduling.step[0].input_map",
         "input(s) b of model 'two' are not mapped"),
        ([_step("det", {"x": "IN"}, {"q": "OUT"})], None, "ensemble_scheduling.step[0].output_map['q']",
         "'q' is not an output of model 'det'"),
        ([_step("det", {"x": "ghost"}, {"y": "OUT"})], None, "ensemble_scheduling.step[0].input_map['x']",
         "tensor 'ghost' is consumed but never produced"),
        ([_step("det", {"x": "IN"}, {"y": "OUT"}), _step("det", {"x": "IN"}, {"y": "OUT"})], None,
         "ensemble_scheduling.step[1].output_map['y']",
         "tensor 'OUT' is already produced by step 0 'det' output 'y'"),
        ([_step("det", {"x": "IN"}, {"y": "IN"})], None, "ensemble_scheduling.step[0].output_map['y']",
         "already produced by ensemble input 'IN'"),
        ([_step("det", {"x": "IN"}, {"y": "t"})], None, "output 'OUT'",
         "the ensemble output is never produced"),
        ([_step("ints", {"i": "IN"}, {"o": "OUT"})], None, "ensemble_scheduling.step[0].input_map['i']",
         "data type mismatch: 'IN' is TYPE_FP32 (ensemble input 'IN') but input 'i' of model 'ints' is "
         "TYPE_INT32"),
        ([_step("det", {"x": "IN"}, {"y": "OUT"})], '{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }',
         "output 'OUT'.data_type", "TYPE_INT32 but step 0 'det' output 'y' is TYPE_FP32"),
        ([_step("two", {"a": "IN", "b": "t2"}, {"c": "t1"}),
          _step("two", {"a": "t1", "b": "IN"}, {"c": "t2"}),
          _step("det", {"x": "t1"}, {"y": "OUT"})], None, "ensemble_scheduling.step",
         "the steps form a cycle"),
        ([_step("two", {"a": "IN", "b": "t1"}, {"c": "t1"}), _step("det", {"x": "t1"}, {"y": "OUT"})], None,
         "ensemble_scheduling.step", "the steps form a cycle (step 0 'two' needs [0]"),
    ],
)  # fmt: skip
def test_graph_errors(steps: list[str], outputs: str | None, field: str, words: str) -> None:
    config = _config(", ".join(steps)) if outputs is None else _config(", ".join(steps), outputs)
    error = _error(config)
    assert error.field == field, error.message
    assert words in error.problem, error.message
    if "not in the model repository" in words:
        assert error.status is Status.NOT_FOUND and "add its folder or correct the name" in error.problem


def test_config_level_checks() -> None:
    steps = _step("det", {"x": "IN"}, {"y": "OUT"})
    with pytest.raises(RepositoryError) as platform:
        validate(text_format.Parse(
            'name: "ens" input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ] '
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ] '
            f"ensemble_scheduling {{ step [ {steps} ] }}", mc.ModelConfig()), WHERE, "ens")  # fmt: skip
    assert platform.value.field == "platform" and 'must have platform: "ensemble"' in platform.value.problem
    bare = _config(steps)
    bare.ClearField("ensemble_scheduling")
    with pytest.raises(RepositoryError) as missing:
        validate(bare, WHERE, "ens")
    assert missing.value.field == "ensemble_scheduling"
    with_instances = _config(steps)
    with_instances.instance_group.add(count=1)
    with pytest.raises(RepositoryError) as instances:
        validate(with_instances, WHERE, "ens")
    assert instances.value.field == "instance_group" and "remove instance_group" in instances.value.problem
    validate(_config(steps), WHERE, "ens")  # a valid ensemble passes config.py's checks
