"""Issue 34 item 2: where the config leaves `max_batch_size` open, the plan races the batch size on the
race's winner and serves the knee. The decision is checked from its inputs (timings fed to the pure
function); the real races (onnxruntime, openvino on a small real model) are checked for what they
decided and served, never for how fast the box is."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hw_helpers import settings
from race_models import WIDE_CONFIG, build_wide_mlp

from edgeserve.backends.base import get_backend
from edgeserve.hardware.batch_choice import BatchChoice, Timing, knee
from edgeserve.hardware.race import BATCH_PENDING
from edgeserve.hardware.race_batch import batch_open, sizes_for
from edgeserve.hardware.race_result import MIN_MARGIN, RaceResult
from edgeserve.hardware.runtimes import inventory
from edgeserve.hardware.selector import PlanSelector
from edgeserve.protocol.model_config import parse_json
from edgeserve.repository import autocomplete
from edgeserve.repository.config import parse_pbtxt
from edgeserve.repository.served import prepare_version

# Generous: the race of this small model ends after its rounds, long before; a busy box must not make
# it run out of budget (which would leave the batch size to the background race, and nothing to check).
BUDGET_S = 120.0


def _t(median: float, spread: float = 0.0) -> Timing:
    return Timing(median, median * (1 - spread), median * (1 + spread))


# -- the decision, from its inputs ---------------------------------------------------------------------


def test_the_knee_is_the_smallest_size_within_the_margin_of_the_best() -> None:
    flat_after_4 = {1: _t(1.0), 2: _t(0.6), 4: _t(0.4), 8: _t(0.39), 16: _t(0.385)}
    size, why = knee(flat_after_4, 15, MIN_MARGIN)
    assert size == 4, why  # 8 and 16 gain under 5% each: only latency
    assert "within 5% of the fastest (batch 16" in why
    assert knee({1: _t(1.0), 2: _t(0.5), 4: _t(0.25), 8: _t(0.12), 16: _t(0.06)}, 15, MIN_MARGIN)[0] == 16
    # batching that does not pay (a model that already uses every core at batch 1): batch 1
    assert knee({1: _t(0.5), 2: _t(0.52), 4: _t(0.55), 8: _t(0.6)}, 15, MIN_MARGIN)[0] == 1
    # a gain just past the margin counts
    assert knee({1: _t(1.0), 2: _t(1.0 / (1 + MIN_MARGIN) - 0.01)}, 15, MIN_MARGIN)[0] == 2


def test_a_gain_inside_the_noise_is_no_reason_to_batch_more() -> None:
    """Under a CPU hog samples vary +-40%: a 15% gain over 4 rounds (noise / sqrt(4) = 20%) is noise,
    the same gain measured on a quiet box is not."""
    noisy = {1: _t(1.0, 0.4), 2: _t(0.87, 0.4)}
    assert knee(noisy, 4, MIN_MARGIN)[0] == 1
    quiet = {1: _t(1.0, 0.02), 2: _t(0.87, 0.02)}
    assert knee(quiet, 4, MIN_MARGIN)[0] == 2
    # more rounds narrow the noise of the medians: the same spread over 64 rounds is 5%
    assert knee(noisy, 64, MIN_MARGIN)[0] == 2
    with pytest.raises(ValueError):
        knee({}, 3, MIN_MARGIN)


def test_the_served_max_batch_size_keeps_the_default_as_its_floor_and_round_trips() -> None:
    timings = {1: _t(1.0), 2: _t(0.6), 4: _t(0.4), 8: _t(0.2), 16: _t(0.199)}
    small = BatchChoice.decide({1: _t(0.5), 2: _t(0.5)}, 5, MIN_MARGIN, 4, "onnxruntime fp32 1x2")
    assert (small.size, small.max_batch_size) == (1, 4)  # a request of 4 rows, admitted before, still is
    big = BatchChoice.decide(timings, 15, MIN_MARGIN, 4, "onnxruntime fp32 2x1")
    assert (big.size, big.max_batch_size) == (8, 8)
    text = big.summary()
    assert text.startswith("max_batch_size 8, preferred_batch_size 8: batch 8 is within 5%")
    assert "on onnxruntime fp32 2x1: 1: 1, 2: 0.6, 4: 0.4, 8: 0.2, 16: 0.199; 15 rounds; final" in text
    again = BatchChoice.from_dict(big.to_dict())
    assert again == big
    result = RaceResult("m", ["1 in flight"], [], batch=big)
    assert RaceResult.from_dict(result.to_dict()).batch == big  # as the race cache stores it
    assert result.to_dict()["plan"]["batch"] == text
    for broken in ({"size": 2}, {**big.to_dict(), "timings": {"1": [1.0]}}):
        with pytest.raises((KeyError, ValueError)):
            BatchChoice.from_dict(broken)
    assert "not raced: no room" in BatchChoice(0, 4, final=False, why="no room").summary()


def test_the_sizes_raced_are_capped_by_the_setting_and_by_memory() -> None:
    feed = {"x": np.zeros((1, 256), np.float32)}  # 1 KiB per inference, 64 KiB of working memory
    assert sizes_for(16, feed, 1, None) == [1, 2, 4, 8, 16]
    assert sizes_for(6, feed, 1, None) == [1, 2, 4, 6]
    assert sizes_for(32, feed, 1, None) == [1, 2, 4, 8, 16, 32]
    assert sizes_for(10**6, feed, 1, None) == [1, 2, 4, 8, 16, 256]  # a typo does not build a huge feed
    assert sizes_for(1, feed, 1, None) == [] and sizes_for(0, feed, 1, None) == []  # off
    assert sizes_for(16, feed, 1, 4 * 64 * 1024) == [1, 2, 4]  # two instances would need twice that
    assert sizes_for(16, feed, 2, 4 * 64 * 1024) == [1, 2]
    assert sizes_for(16, feed, 1, 1024) == []  # nothing but batch 1 fits: not raced


# -- what the config leaves open -------------------------------------------------------------------------


def _open(tmp_path: Path, text: str | None, sent: Any = None, model: Path | None = None) -> bool:
    folder = tmp_path / "m"
    onnx = model or build_wide_mlp(folder / "1" / "model.onnx")
    where = folder / "config.pbtxt"
    if text is not None:
        where.write_text(text)
    elif where.exists():
        where.unlink()
    config = sent if sent is not None else (parse_pbtxt(where) if text is not None else None)
    from tritonclient.grpc import model_config_pb2 as mc

    config = config if config is not None else mc.ModelConfig()
    completed = autocomplete.complete(
        config, get_backend("onnxruntime").inspect(onnx), model_name="m", backend_name="onnxruntime",
        platform="", model_file="model.onnx", default_max_batch_size=4, where=str(where),
    )  # fmt: skip
    return batch_open(config, completed, str(where))


def test_only_an_absent_max_batch_size_is_the_plans_to_choose(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    assert _open(tmp_path, None)  # no config.pbtxt at all
    assert batch_open(None, autocomplete.complete(  # `edgeserve detect --model` passes None for it
        parse_json("{}", "none"), get_backend("onnxruntime").inspect(tmp_path / "m" / "1" / "model.onnx"),
        model_name="m", backend_name="onnxruntime", platform="", model_file="model.onnx",
        default_max_batch_size=4,
    ), str(tmp_path / "m" / "config.pbtxt"))  # fmt: skip
    assert _open(tmp_path, 'backend: "onnxruntime"\n')
    assert _open(tmp_path, 'backend: "onnxruntime"\n# max_batch_size: 8 (a comment)\n')
    assert _open(tmp_path, 'backend: "onnxruntime"\ndynamic_batching { max_queue_delay_microseconds: 100 }\n')
    assert not _open(tmp_path, "max_batch_size: 0\n")  # set, to 0 (auto-complete makes it 4, as Triton)
    assert not _open(tmp_path, 'backend: "onnxruntime"\n  max_batch_size :0\n')
    assert not _open(tmp_path, WIDE_CONFIG)  # set to 8, tensors declared
    assert not _open(tmp_path, "dynamic_batching { preferred_batch_size: [ 8 ] }\n")  # needs its max
    assert not _open(tmp_path, 'input [ { name: "x", data_type: TYPE_FP32, dims: [ -1, 256 ] } ]\n')
    # a config sent with a load request (not the folder's file): it may have named it
    sent = parse_json('{"backend": "onnxruntime"}', "load request")
    assert not _open(tmp_path, 'backend: "openvino"\n', sent=sent)
    # a model whose first axis is fixed cannot batch: auto-complete leaves max_batch_size 0
    from onnx_models import build_add_sub

    fixed = build_add_sub(tmp_path / "fixed" / "model.onnx", batch=False)
    assert not _open(tmp_path, 'backend: "onnxruntime"\n', model=fixed)


# -- real races ------------------------------------------------------------------------------------------


def _model(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "repo" / "wide"
    build_wide_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(text)
    return folder


def _selector(tmp_path: Path, **runtime: object) -> PlanSelector:
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    pytest.importorskip("openvino", reason="openvino is not installed")
    s = settings(tmp_path, race_budget_s=BUDGET_S, **runtime)
    return PlanSelector(s, runtimes=inventory(dict.fromkeys(("onnxruntime", "openvino"), "x")))


def _race(selector: PlanSelector, model: Path) -> RaceResult | None:
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    plan = selector.plan("wide", model / "1", config, where)
    return selector.racer.run(plan, "wide", model / "1", config, where)


def _prepare(selector: PlanSelector, model: Path) -> Any:
    config = parse_pbtxt(model / "config.pbtxt")
    prepared = prepare_version(
        selector, "wide", model, 1, model / "1", config, str(model / "config.pbtxt"), 4
    )
    for instance in prepared.instances:
        instance.close()
    return prepared


@pytest.mark.parametrize("pin", ["", 'backend: "onnxruntime"\n'])
def test_the_race_measures_the_batch_size_and_the_served_config_takes_its_knee(
    pin: str, tmp_path: Path
) -> None:
    model = _model(tmp_path, pin)
    selector = _selector(tmp_path)
    race = _race(selector, model)
    if race is None:
        pytest.skip("one CPU and one runtime: nothing to race")
    batch = race.batch
    assert batch is not None and race.chosen is not None, race.summary()
    assert batch.final and batch.layout == race.chosen.label(), batch.summary()
    assert list(batch.timings) == ["1", "2", "4", "8", "16"] and batch.rounds >= 3
    timings = {int(b): Timing(*v) for b, v in batch.timings.items()}
    assert (batch.size, batch.why) == knee(timings, batch.rounds, MIN_MARGIN)  # the decision from them
    assert batch.max_batch_size == max(batch.size, 4)
    prepared = _prepare(selector, model)
    config = prepared.config
    assert config.max_batch_size == batch.max_batch_size
    assert list(config.dynamic_batching.preferred_batch_size) == [batch.size]
    assert config.parameters["batch_size_choice"].string_value == batch.summary()
    assert batch.summary() in config.parameters["runtime_choice"].string_value
    assert list(config.input[0].dims) == [256]  # the batch axis left dims, as for any batching model


def test_a_config_that_fixes_runtime_and_layout_still_has_its_open_batch_size_raced(tmp_path: Path) -> None:
    model = _model(
        tmp_path,
        'backend: "onnxruntime"\ninstance_group [ { count: 2, kind: KIND_CPU } ]\n'
        'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n',
    )
    selector = _selector(tmp_path)
    race = _race(selector, model)
    assert race is not None and race.chosen is None and race.fallback is not None, "one candidate"
    assert "the config fixes the runtime and its layout" in race.fallback
    assert race.batch is not None and race.batch.final and race.batch.layout.startswith("onnxruntime fp32 2x")
    prepared = _prepare(selector, model)
    assert prepared.choice.backend_name == "onnxruntime" and len(prepared.instances) == 2
    assert prepared.config.max_batch_size == race.batch.max_batch_size
    assert list(prepared.config.dynamic_batching.preferred_batch_size) == [race.batch.size]
    assert prepared.config.parameters["batch_size_choice"].string_value == race.batch.summary()


def test_a_config_that_sets_max_batch_size_is_never_changed(tmp_path: Path) -> None:
    selector = _selector(tmp_path)
    for text, served in ((WIDE_CONFIG, 8), ('backend: "onnxruntime"\nmax_batch_size: 0\n', 4)):
        model = _model(tmp_path / str(served), text)
        race = _race(selector, model)
        assert race is None or race.batch is None, race.summary() if race else ""
        config = _prepare(selector, model).config
        assert config.max_batch_size == served  # 0 with no tensors: auto-complete's 4, as before
        assert not config.dynamic_batching.preferred_batch_size
        assert "batch_size_choice" not in config.parameters


def test_the_cached_batch_size_is_served_at_once(tmp_path: Path) -> None:
    model = _model(tmp_path, 'backend: "onnxruntime"\n')
    selector = _selector(tmp_path)
    race = _race(selector, model)
    if race is None:
        pytest.skip("one CPU: nothing to race")
    assert race.batch is not None
    # The cache entry says 2 (whatever this box measured): what serves comes from it, not a new race.
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    job = selector.racer.prepare(selector.plan("wide", model / "1", config, where), "wide", model / "1",
                                 config, where)  # fmt: skip
    assert job is not None and job.batch_sizes == [1, 2, 4, 8, 16]
    planted = dataclasses.replace(race.batch, size=2, max_batch_size=4, why="planted")
    selector.racer.cache.put(job.digest, job.key, dataclasses.replace(race, batch=planted))
    again = _race(selector, model)
    assert again is not None and again.cached and again.batch == planted
    prepared = _prepare(selector, model)
    assert prepared.config.max_batch_size == 4
    assert list(prepared.config.dynamic_batching.preferred_batch_size) == [2]
    assert "planted" in prepared.config.parameters["batch_size_choice"].string_value
    # another cap is another key: raced again, not the planted entry
    other = _selector(tmp_path, race_max_batch_size=8)
    fresh = _race(other, model)
    assert fresh is not None and not fresh.cached and fresh.batch is not None
    assert list(fresh.batch.timings) == ["1", "2", "4", "8"]


def test_a_batch_size_that_does_not_fit_the_budget_is_provisional_and_finished_in_the_background(
    tmp_path: Path,
) -> None:
    from edgeserve.hardware.race_background import BackgroundRaces

    model = _model(tmp_path, 'backend: "onnxruntime"\n')
    selector = _selector(tmp_path)
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    job = selector.racer.prepare(selector.plan("wide", model / "1", config, where), "wide", model / "1",
                                 config, where)  # fmt: skip
    if job is None:
        pytest.skip("one CPU: nothing to race")
    result = selector.racer.race(job, job.entrants)
    assert result.chosen is not None
    if not result.final:  # a noisy near tie (a busy box): the runtimes are raced on too (below)
        result.final, result.evidence = True, ""  # as on a quiet box, so the batch-only path is taken
    selector.racer.race_batch(job, result, 0.0)  # nothing left of the budget
    assert result.batch is not None and result.batch.size == 0 and not result.batch.final
    assert not result.final and result.evidence == BATCH_PENDING
    assert "batch size not raced: the 0.0s left" in result.summary()
    switched: list[str] = []
    background = BackgroundRaces(budget_s=BUDGET_S)
    background.attach(lambda: False, switched.append)
    final = background.finish(selector.racer, job, result)
    assert final.final and final.batch is not None and final.batch.final and final.batch.size > 0
    # the runtime's race was final: not raced again (its rows as they were), only the batch sizes
    assert final.rows == result.rows and final.winner == result.winner and final.evidence == ""
    assert switched == ["wide"]  # a batch size where the default served: the model is reloaded onto it
    cached = selector.racer.cache.get(job.digest, job.key)
    assert cached is not None and cached.final and cached.batch == final.batch


def test_a_batch_size_that_fails_or_a_load_that_fails_leaves_the_default(tmp_path: Path) -> None:
    """Never a failed load: a model that says it batches but runs only batch 1 (a MatMul whose inner
    dimension is the batch axis), or a winner that no longer loads, keeps auto-complete's default,
    final, and says why."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx_models import _save

    from edgeserve.hardware.race_batch import measure

    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["t"]),  # [256, N]
            helper.make_node("MatMul", ["t", "W"], ["m"]),  # [256, N] @ [1, 256]: only N == 1 runs
            helper.make_node("ReduceSum", ["m"], ["s"], keepdims=0),
            helper.make_node("Mul", ["x", "s"], ["y"]),  # [N, 256]: the signature says it batches
        ],
        "batch_one_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 256])],
        [numpy_helper.from_array(np.full((1, 256), 1e-3, np.float32), "W")],
    )
    model = tmp_path / "repo" / "one"
    _save(graph, model / "1" / "model.onnx")
    (model / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    selector = _selector(tmp_path)
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    job = selector.racer.prepare(selector.plan("one", model / "1", config, where), "one", model / "1",
                                 config, where)  # fmt: skip
    assert job is not None and job.batch_sizes == [1, 2, 4, 8, 16]
    entrant = job.entrants[0]
    choice = measure(entrant, job.batch_sizes, job.feeds[1], job.completed, BUDGET_S, 4)
    assert (choice.size, choice.max_batch_size, choice.final) == (0, 4, True)
    assert choice.why == f"only batch 1 ran on {entrant.row.label()}" and not entrant.instances
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model any more")
    gone = dataclasses.replace(entrant, artifact=broken)
    choice = measure(gone, job.batch_sizes, job.feeds[1], job.completed, BUDGET_S, 4)
    assert choice.size == 0 and choice.final and "did not load again" in choice.why
    assert "auto-complete's default serves" in choice.summary()
