"""Only what the config fixes is fixed: a config that names the backend (or the precision) still has the
layouts it leaves open raced (instances x threads), on real onnxruntime and openvino. Timings are never
asserted (machines are noisy): which candidates are raced, and that what is served is the race's winner
under the config's pins."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hw_helpers import settings
from race_models import WIDE_CONFIG, build_wide_mlp

from edgeserve.backends.options import PINNED_PARAMETER
from edgeserve.hardware.race_result import REJECTED, RaceResult
from edgeserve.hardware.runtimes import inventory
from edgeserve.hardware.selector import PlanSelector
from edgeserve.repository.config import parse_pbtxt
from edgeserve.repository.served import prepare_version

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
pytest.importorskip("openvino", reason="openvino is not installed")

CONFIG = WIDE_CONFIG + "dynamic_batching { preferred_batch_size: [ 4 ] }\n"
# Generous: the race of this small model ends after its rounds, long before; a busy box must not make
# it run out of budget (which would leave the rule's choice, and nothing to check).
BUDGET_S = 120.0


def _model(tmp_path: Path, extra: str) -> Path:
    folder = tmp_path / "repo" / "wide"
    build_wide_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG + extra)
    return folder


def _selector(tmp_path: Path) -> PlanSelector:
    s = settings(tmp_path, race_budget_s=BUDGET_S)
    selector = PlanSelector(s, runtimes=inventory(dict.fromkeys(("onnxruntime", "openvino"), "x")))
    if selector.planner.threads()[0] < 2:
        pytest.skip("one CPU: a single layout, nothing to race")
    return selector


def _race(selector: PlanSelector, model: Path) -> RaceResult | None:
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    plan = selector.plan("wide", model / "1", config, where)
    return selector.racer.run(plan, "wide", model / "1", config, where)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_pinned_backend_still_races_instances_x_threads(backend: str, tmp_path: Path) -> None:
    model = _model(tmp_path, f'backend: "{backend}"\n')
    selector = _selector(tmp_path)
    race = _race(selector, model)
    assert race is not None, "a config naming only the backend left the layout open: it is raced"
    assert {r.backend for r in race.rows} == {backend}, race.table()  # the other runtime is no candidate
    total = selector.planner.threads()[0]
    layouts = {(r.instances, r.threads) for r in race.rows}
    assert {(1, total), (2, total // 2)} <= layouts, race.table()
    passing = [r for r in race.ranked() if r.status != REJECTED]  # a bf16 row may fail the guard
    assert race.chosen is not None and race.chosen is passing[0], race.table()
    # what is served is the race's winner, still pinned (the backend keeps the config's word)
    config = parse_pbtxt(model / "config.pbtxt")
    choice = selector.choose("wide", model, model / "1", config)
    assert choice.backend_name == backend
    assert (choice.instances, choice.options.threads) == (race.chosen.instances, race.chosen.threads)
    assert choice.options.parameters[PINNED_PARAMETER] == backend
    assert f"backend pinned by config backend '{backend}', instances x threads raced" in choice.reason
    assert all(f.backend_name == backend for f in choice.fallbacks)
    prepared = prepare_version(
        selector, "wide", model, 1, model / "1", config, str(model / "config.pbtxt"), 4
    )
    try:
        assert len(prepared.instances) == race.chosen.instances
        assert sum(g.count for g in prepared.config.instance_group) == race.chosen.instances
        shown = prepared.config.parameters  # the threads too, as Triton's ORT backend parameter
        if backend == "onnxruntime":
            assert shown["intra_op_thread_count"].string_value == str(race.chosen.threads)
        else:
            assert "intra_op_thread_count" not in shown
    finally:
        for instance in prepared.instances:
            instance.close()


def test_a_config_that_fixes_backend_instances_and_threads_is_not_raced(tmp_path: Path) -> None:
    model = _model(
        tmp_path,
        'backend: "onnxruntime"\ninstance_group [ { count: 2, kind: KIND_CPU } ]\n'
        'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n',
    )
    selector = _selector(tmp_path)
    assert _race(selector, model) is None  # one layout left: nothing to race
    choice = selector.choose("wide", model, model / "1", parse_pbtxt(model / "config.pbtxt"))
    assert choice.backend_name == "onnxruntime" and "pinned by config backend 'onnxruntime'" in choice.reason


def test_a_pinned_instance_count_narrows_the_layouts_of_a_pinned_backend(tmp_path: Path) -> None:
    model = _model(
        tmp_path, 'platform: "onnxruntime_onnx"\ninstance_group [ { count: 1, kind: KIND_CPU } ]\n'
    )
    selector = _selector(tmp_path)
    race = _race(selector, model)
    total = selector.planner.threads()[0]
    assert race is not None and {(r.instances, r.threads) for r in race.rows} == {(1, total), (1, 1)}


def test_a_pinned_precision_races_both_runtimes_at_that_precision(tmp_path: Path) -> None:
    model = _model(tmp_path, 'parameters { key: "precision" value: { string_value: "fp32" } }\n')
    selector = _selector(tmp_path)
    race = _race(selector, model)
    assert race is not None and {r.backend for r in race.rows} == {"onnxruntime", "openvino"}
    assert {r.precision for r in race.rows} == {"fp32"}, race.table()  # bf16 is no candidate, not a row
    assert all(r.status != REJECTED or r.score_ms is not None for r in race.rows), race.table()


def test_a_real_server_serves_the_raced_layout_of_a_pinned_backend_and_again_after_a_restart(
    tmp_path: Path,
) -> None:
    from es_server import start_server

    model = _model(tmp_path, 'backend: "onnxruntime"\n')
    _selector(tmp_path)  # skips on a one-CPU box
    env = {"EDGESERVE_RUNTIME_RACE_BUDGET_S": str(BUDGET_S)}

    def served() -> tuple[dict[str, Any], list[float]]:
        # generous: starting two runtimes and racing on a 2-core box under other tests' load is slow
        server = start_server(model.parent, tmp_path, env=env, timeout=600.0)
        try:
            with urllib.request.urlopen(f"{server.base}/v2/models/wide/config", timeout=60) as response:
                config = json.loads(response.read())
            body = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}
            request = urllib.request.Request(
                f"{server.base}/v2/models/wide/infer", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = json.loads(response.read())
        finally:
            server.stop()
        return config, answer["outputs"][0]["data"]

    config, first = served()
    choice = config["parameters"]["runtime_choice"]["string_value"]
    assert "raced: onnxruntime fp32 " in choice and "backend pinned by config backend 'onnxruntime'" in choice
    assert "openvino" not in choice  # only the pinned runtime was a candidate
    winner = choice.split("raced: onnxruntime fp32 ")[1].split()[0]  # e.g. "2x1"
    instances, threads = (int(n) for n in winner.split("x"))
    assert sum(int(g.get("count", 1)) for g in config["instance_group"]) == instances
    assert config["parameters"]["intra_op_thread_count"]["string_value"] == str(threads)
    again, second = served()  # the restart reads the cached race: the same layout, the same answers
    assert "cached" in again["parameters"]["runtime_choice"]["string_value"]
    assert f"raced: onnxruntime fp32 {winner}" in again["parameters"]["runtime_choice"]["string_value"]
    assert second == first
