"""Ensembles (Triton's ensemble_scheduling) on real ONNX models, the real repository, schedulers and
data plane: the DAG, parallel steps, statistics, failures naming the step, batch splitting, load /
unload of composing models, and the load-time validation of the graph."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_models import _save, write_model

from edgeserve.config import Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InputTensor, RequestedOutput
from edgeserve.repository.manager import ModelRepository
from edgeserve.server.dataplane import DataPlane

ADD_SUB = """
name: "add_sub" backend: "onnxruntime" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
"""
SMALL = ADD_SUB.replace('"add_sub"', '"small"').replace("max_batch_size: 8", "max_batch_size: 2")
TEXT = """
name: "text" backend: "onnxruntime" max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
BROKEN = """
name: "broken" backend: "onnxruntime" max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "C" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
# IN0, IN1 -> add_sub -> (s, d) -> add_sub -> (2a, 2b); WORDS -> text -> WORDS_OUT in parallel.
ENSEMBLE = """
name: "ens" platform: "ensemble" max_batch_size: 0
input [ { name: "IN0" data_type: TYPE_FP32 dims: [ -1, 4 ] },
        { name: "IN1" data_type: TYPE_FP32 dims: [ -1, 4 ] },
        { name: "WORDS" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "TWO_A" data_type: TYPE_FP32 dims: [ -1, 4 ] },
         { name: "TWO_B" data_type: TYPE_FP32 dims: [ -1, 4 ] },
         { name: "WORDS_OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "IN0" } input_map { key: "INPUT1" value: "IN1" }
    output_map { key: "OUTPUT0" value: "s" } output_map { key: "OUTPUT1" value: "d" } },
  { model_name: "add_sub" model_version: 1
    input_map { key: "INPUT0" value: "s" } input_map { key: "INPUT1" value: "d" }
    output_map { key: "OUTPUT0" value: "TWO_A" } output_map { key: "OUTPUT1" value: "TWO_B" } },
  { model_name: "text" model_version: -1
    input_map { key: "INPUT0" value: "WORDS" } output_map { key: "OUTPUT0" value: "WORDS_OUT" } }
] }
"""


def _broken_model(path: Path) -> None:
    """C = A + B: fine for equal lengths, a runtime error for lengths 3 and 4 (no broadcast)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["C"])], "broken",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["N", "X"]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, ["N", "Y"])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, ["N", "Z"])],
    )  # fmt: skip
    _save(graph, path)


def _ensemble(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    write_model(repo, "add_sub", "add_sub", config=ADD_SUB, dims=4)
    write_model(repo, "small", "add_sub", config=SMALL, dims=4)
    write_model(repo, "text", "identity", config=TEXT, datatype="BYTES", shape=["D"])
    _broken_model(repo / "broken" / "1" / "model.onnx")
    (repo / "broken" / "config.pbtxt").write_text(BROKEN)
    _ensemble(repo, "ens", ENSEMBLE)
    return repo


Plane = Callable[..., Any]


@pytest.fixture
async def make_plane(tmp_path: Path) -> AsyncIterator[Plane]:
    made: list[ModelRepository] = []

    async def factory(repo: Path, load_models: list[str] | None = None) -> DataPlane:
        settings = Settings()
        settings.server.model_repository = repo
        settings.server.state_dir = tmp_path / "state"
        settings.server.load_models = ["*"] if load_models is None else load_models
        settings.server.exit_timeout_s = 10.0
        settings.runtime.cpu_threads = 1
        repository = ModelRepository(settings)
        made.append(repository)
        await repository.start()
        return DataPlane(repository, SharedMemoryRegistry(False, (), 4))

    yield factory
    for repository in made:
        await repository.close()


def _request(
    model: str, outputs: list[str] | None = None, timeout_us: int = 0, **arrays: Any
) -> InferRequest:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else "FP32"
        inputs.append(InputTensor(name, datatype, tuple(array.shape), array))
    wanted = [RequestedOutput(n) for n in outputs] if outputs is not None else None
    return InferRequest(model, inputs=inputs, outputs=wanted, timeout_us=timeout_us)


async def _idle(plane: DataPlane, *models: str) -> None:
    """Wait until the models' schedulers are idle: a scheduler records a batch's statistics just
    after it answers the batch's jobs, so the ensemble's answer can come first."""
    import asyncio

    for model in models:
        scheduler = plane.repository.get(model).scheduler
        assert await asyncio.to_thread(scheduler.wait_idle, 10.0)  # type: ignore[attr-defined]


def _outputs(response: Any) -> dict[str, Any]:
    return {o.name: o.data for o in response.outputs}


async def test_dag_outputs_parallel_steps_and_statistics(repo_dir: Path, make_plane: Plane) -> None:
    plane = await make_plane(repo_dir)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((3, 4), dtype=np.float32)
    words = np.array([b"EDGESERVE", b"2026"], dtype=np.object_)
    out = _outputs(await plane.infer(_request("ens", IN0=a, IN1=b, WORDS=words)))
    assert set(out) == {"TWO_A", "TWO_B", "WORDS_OUT"}
    np.testing.assert_allclose(out["TWO_A"], 2 * a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["TWO_B"], 2 * b, rtol=1e-5, atol=1e-5)
    assert list(out["WORDS_OUT"]) == [b"EDGESERVE", b"2026"]
    # only the requested outputs come back, and only the steps they need run (not "text")
    only = _outputs(await plane.infer(_request("ens", ["TWO_B"], IN0=a, IN1=b, WORDS=words)))
    assert list(only) == ["TWO_B"]

    await _idle(plane, "add_sub", "text")
    stats = {(s["name"], s["version"]): s for s in plane.statistics()["model_stats"]}
    assert stats[("ens", "1")]["inference_stats"]["success"]["count"] == 2
    assert stats[("add_sub", "1")]["inference_stats"]["success"]["count"] == 4  # two steps per request
    assert stats[("text", "1")]["inference_stats"]["success"]["count"] == 1
    steps = stats[("ens", "1")]["ensemble_steps"]
    assert [(s["step"], s["model"], s["success"]["count"]) for s in steps] == [
        (0, "add_sub", 2), (1, "add_sub", 2), (2, "text", 1)
    ]  # fmt: skip
    metadata = plane.model_metadata("ens")
    assert metadata["platform"] == "ensemble" and [i["name"] for i in metadata["inputs"]] == [
        "IN0",
        "IN1",
        "WORDS",
    ]
    index = {e["name"]: e for e in plane.repository_index()}
    assert index["ens"]["state"] == "READY"


async def test_concurrent_requests_batch_in_the_step_models(repo_dir: Path, make_plane: Plane) -> None:
    import asyncio

    plane = await make_plane(repo_dir)
    rng = np.random.default_rng(1)
    pairs = [(rng.standard_normal((1, 4), dtype=np.float32), rng.standard_normal((1, 4), dtype=np.float32))
             for _ in range(24)]  # fmt: skip
    words = np.array([b"x"], dtype=np.object_)
    results = await asyncio.gather(
        *(plane.infer(_request("ens", IN0=a, IN1=b, WORDS=words)) for a, b in pairs)
    )
    for (a, b), response in zip(pairs, results, strict=True):
        out = _outputs(response)
        np.testing.assert_allclose(out["TWO_A"], 2 * a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["TWO_B"], 2 * b, rtol=1e-5, atol=1e-5)
    await _idle(plane, "add_sub")
    add_sub = next(s for s in plane.statistics("add_sub")["model_stats"])
    assert add_sub["inference_count"] == 48
    assert add_sub["execution_count"] <= 48  # steps of different requests may share a batch


async def test_a_failing_step_fails_the_request_with_the_step_named(tmp_path: Path, repo_dir: Path,
                                                                   make_plane: Plane) -> None:  # fmt: skip
    _ensemble(repo_dir, "bad", """
name: "bad" platform: "ensemble" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "W" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" input_map { key: "INPUT0" value: "X" } input_map { key: "INPUT1" value: "X" }
    output_map { key: "OUTPUT0" value: "x2" } output_map { key: "OUTPUT1" value: "zero" } },
  { model_name: "broken" input_map { key: "A" value: "x2" } input_map { key: "B" value: "Y" }
    output_map { key: "C" value: "Z" } },
  { model_name: "broken" input_map { key: "A" value: "Z" } input_map { key: "B" value: "Z" }
    output_map { key: "C" value: "W" } }
] }
""")  # fmt: skip
    plane = await make_plane(repo_dir)
    x, y = np.ones((1, 4), np.float32), np.ones((1, 3), np.float32)
    with pytest.raises(InferenceError) as failed:
        await plane.infer(_request("bad", X=x, Y=y))
    assert failed.value.message.startswith("ensemble 'bad' step 1 'broken': ")
    await _idle(plane, "add_sub", "broken")
    stats = {s["name"]: s for s in plane.statistics()["model_stats"]}
    assert stats["bad"]["inference_stats"]["fail"]["count"] == 1
    steps = stats["bad"]["ensemble_steps"]
    assert [(s["success"]["count"], s["fail"]) for s in steps] == [(1, 0), (0, 1), (0, 0)]  # step 2 never ran
    assert stats["add_sub"]["inference_stats"]["success"]["count"] == 1
    # a step input that does not fit its model is refused as a request to that model would be
    _ensemble(
        repo_dir,
        "shape",
        ENSEMBLE.replace('"ens"', '"shape"').replace(
            'name: "IN1" data_type: TYPE_FP32 dims: [ -1, 4 ]',
            'name: "IN1" data_type: TYPE_FP32 dims: [ -1, -1 ]',
        ),
    )
    await plane.load_model("shape")
    with pytest.raises(InferenceError) as shape:
        await plane.infer(_request("shape", IN0=x, IN1=np.ones((1, 5), np.float32),
                                   WORDS=np.array([b"w"], dtype=np.object_)))  # fmt: skip
    assert shape.value.status is Status.INVALID_ARG
    assert shape.value.message.startswith(
        "ensemble 'shape' step 0 'add_sub': unexpected shape for input 'INPUT1'"
    )
    # the deadline covers the whole DAG
    with pytest.raises(InferenceError) as late:
        await plane.infer(
            _request("ens", timeout_us=1, IN0=x, IN1=x, WORDS=np.array([b"w"], dtype=np.object_))
        )
    assert late.value.status is Status.UNAVAILABLE and "timeout" in late.value.message


# X -> small (max_batch_size 2): a request of more rows is split into steps of 2
SPLIT = """
name: "split" platform: "ensemble" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
ensemble_scheduling { step [
  { model_name: "small" input_map { key: "INPUT0" value: "X" } input_map { key: "INPUT1" value: "X" }
    output_map { key: "OUTPUT0" value: "Y" } }
] }
"""


async def test_steps_larger_than_max_batch_are_split_and_empty_steps_skip_the_model(
    repo_dir: Path, make_plane: Plane
) -> None:
    _ensemble(repo_dir, "split", SPLIT)
    plane = await make_plane(repo_dir)
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    out = _outputs(await plane.infer(_request("split", X=x)))
    np.testing.assert_allclose(out["Y"], 2 * x)
    await _idle(plane, "small")
    small = plane.statistics("small")["model_stats"][0]
    assert small["inference_count"] == 5 and small["execution_count"] == 3  # 2 + 2 + 1 (max_batch_size 2)
    empty = _outputs(await plane.infer(_request("split", X=np.zeros((0, 4), np.float32))))
    assert empty["Y"].shape == (0, 4)
    assert plane.statistics("small")["model_stats"][0]["execution_count"] == 3


async def test_composing_models_load_with_the_ensemble_and_unloading_one_makes_it_unavailable(
    repo_dir: Path, make_plane: Plane
) -> None:
    plane = await make_plane(repo_dir, load_models=[])
    await plane.load_model("ens")  # explicit mode: loading the ensemble loads its step models
    assert plane.model_ready("ens") and plane.model_ready("add_sub") and plane.model_ready("text")
    assert not plane.model_ready("small")
    await plane.unload_model("text")
    assert not plane.model_ready("ens")
    entry = next(e for e in plane.repository_index() if e["name"] == "ens")
    assert entry["state"] == "UNAVAILABLE"
    assert "composing model 'text' is not ready" in entry["reason"]
    with pytest.raises(InferenceError) as gone:
        await plane.infer(_request("ens", IN0=np.ones((1, 4), np.float32), IN1=np.ones((1, 4), np.float32),
                                   WORDS=np.array([b"w"], dtype=np.object_)))  # fmt: skip
    assert gone.value.status is Status.UNAVAILABLE and "composing model 'text'" in gone.value.message
    assert not plane.repository.all_ready()
    await plane.load_model("text")
    assert plane.model_ready("ens") and plane.repository.all_ready()
    await plane.unload_model("add_sub", unload_dependents=True)
    assert not plane.model_ready("ens")
    assert next(e for e in plane.repository_index() if e["name"] == "ens")["reason"] == "unloaded"


async def test_nested_ensembles_and_a_cycle_between_ensembles(repo_dir: Path, make_plane: Plane) -> None:
    _ensemble(repo_dir, "outer", """
name: "outer" platform: "ensemble" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
ensemble_scheduling { step [
  { model_name: "split" input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } }
] }
""")  # fmt: skip
    _ensemble(repo_dir, "split", SPLIT)
    for name, other in (("loop_a", "loop_b"), ("loop_b", "loop_a")):
        _ensemble(repo_dir, name, f"""
name: "{name}" platform: "ensemble" max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1, 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1, 4 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{other}" input_map {{ key: "X" value: "X" }} output_map {{ key: "Y" value: "Y" }} }}
] }}
""")  # fmt: skip
    plane = await make_plane(repo_dir, load_models=[])
    await plane.load_model("outer")  # loads split, which loads small
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(_outputs(await plane.infer(_request("outer", X=x)))["Y"], 2 * x)
    with pytest.raises(InferenceError) as cycle:
        await plane.load_model("loop_a")
    assert "ensembles form a cycle: loop_a -> loop_b -> loop_a" in cycle.value.message
    entry = next(e for e in plane.repository_index() if e["name"] == "loop_a")
    assert entry["state"] == "UNAVAILABLE" and "cycle" in entry["reason"]


async def test_unloading_a_step_model_under_load_answers_every_request(
    repo_dir: Path, make_plane: Plane
) -> None:
    import asyncio

    plane = await make_plane(repo_dir)
    x = np.ones((1, 4), np.float32)
    words = np.array([b"w"], dtype=np.object_)

    async def one() -> str:
        try:
            await plane.infer(_request("ens", IN0=x, IN1=x, WORDS=words))
        except InferenceError as exc:
            assert exc.status is Status.UNAVAILABLE, exc.message
            return "unavailable"
        return "ok"

    tasks = [asyncio.ensure_future(one()) for _ in range(40)]
    await asyncio.sleep(0)
    await plane.unload_model("add_sub")  # queued steps finish (drain), later ones are refused
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert set(results) <= {"ok", "unavailable"} and len(results) == 40
    with pytest.raises(InferenceError) as refused:
        await plane.infer(_request("ens", IN0=x, IN1=x, WORDS=words))
    assert refused.value.status is Status.UNAVAILABLE
    stats = plane.statistics("ens")["model_stats"][0]["inference_stats"]
    assert stats["success"]["count"] + stats["fail"]["count"] == 40


async def test_optional_ensemble_inputs_left_out(repo_dir: Path, make_plane: Plane) -> None:
    optional = ENSEMBLE.replace('"ens"', '"opt"').replace(
        '{ name: "WORDS" data_type: TYPE_STRING dims: [ -1 ] }',
        '{ name: "WORDS" data_type: TYPE_STRING dims: [ -1 ] optional: true }',
    )
    _ensemble(repo_dir, "opt", optional)
    plane = await make_plane(repo_dir)
    x = np.ones((1, 4), np.float32)
    words = np.array([b"w"], dtype=np.object_)
    out = _outputs(await plane.infer(_request("opt", IN0=x, IN1=x, WORDS=words)))
    assert list(out["WORDS_OUT"]) == [b"w"]
    # left out: the step reading it runs without it, and its model (whose input is required) says so
    with pytest.raises(InferenceError) as missing:
        await plane.infer(_request("opt", IN0=x, IN1=x))
    assert missing.value.status is Status.INVALID_ARG
    assert missing.value.message.startswith("ensemble 'opt' step 2 'text': expected 1 inputs but got 0")


async def test_a_step_model_unloaded_for_the_memory_budget_is_loaded_again_by_the_ensemble(
    repo_dir: Path, make_plane: Plane
) -> None:
    plane = await make_plane(repo_dir)
    repository = plane.repository
    await repository.budget.evict("text")  # as the budget does (it spares an ensemble's steps itself)
    assert not plane.model_ready("text") and plane.model_ready("ens")  # its next request loads it
    x = np.ones((1, 4), np.float32)
    out = _outputs(await plane.infer(_request("ens", IN0=x, IN1=x, WORDS=np.array([b"w"], dtype=np.object_))))
    assert list(out["WORDS_OUT"]) == [b"w"] and plane.model_ready("text")
    assert repository.budget.residency.last_used.get("add_sub", 0) > 0  # steps count as uses (LRU)
    await plane.unload_model("text")  # an explicit unload is not undone by the ensemble
    assert not plane.model_ready("ens")
