"""The load-time race on real onnxruntime and openvino (no runtime mocked). Timings are never asserted
(machines are noisy): the structure, the consistency of the table with the choice, the budget, the
cache and the fallbacks are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hw_helpers import ROOT, settings
from race_models import WIDE_CONFIG, build_wide_mlp

from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.race_result import OVER_BUDGET, REJECTED, TIMED, RaceCache, RaceResult
from edgeserve.hardware.runtimes import inventory
from edgeserve.hardware.selector import PlanSelector
from edgeserve.repository.config import parse_pbtxt
from edgeserve.repository.served import prepare_version

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
pytest.importorskip("openvino", reason="openvino is not installed")

CONFIG = WIDE_CONFIG + "dynamic_batching { preferred_batch_size: [ 4 ] }\n"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "repo" / "wide"
    build_wide_mlp(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(CONFIG)
    return folder


def _selector(
    tmp_path: Path, budget: float = 6.0, runtimes: tuple[str, ...] = ("onnxruntime", "openvino")
) -> PlanSelector:
    s = settings(tmp_path, race_budget_s=budget)
    return PlanSelector(s, runtimes=inventory(dict.fromkeys(runtimes, "x")))


def _race(selector: PlanSelector, model: Path, fresh: bool = False) -> RaceResult | None:
    config = parse_pbtxt(model / "config.pbtxt")
    where = str(model / "config.pbtxt")
    plan = selector.plan("wide", model / "1", config, where)
    return selector.racer.run(plan, "wide", model / "1", config, where, fresh=fresh)


def test_race_serves_the_fastest_timed_candidate(model: Path, tmp_path: Path) -> None:
    selector = _selector(tmp_path)
    race = _race(selector, model)
    assert race is not None and race.fallback is None and not race.cached
    assert race.scenarios == ["1 in flight", "batch 4 x instances"]
    timed = [r for r in race.rows if r.score_ms is not None]
    assert timed, race.table()
    assert {r.backend for r in race.rows} == {"onnxruntime", "openvino"}  # both raced
    for row in race.rows:  # every row was timed, or says why not
        assert (row.status == TIMED and row.score_ms is not None) or row.reason, race.table()
        if "clearly slower at warm-up" in row.reason:  # dropped at warm-up: its warm-up figures are shown
            assert row.status == "skipped" and set(row.ms) == set(race.scenarios)
    total = selector.planner.threads()[0]
    assert {(r.instances, r.threads) for r in timed} <= {(1, total), (2, max(1, total // 2)), (1, 1)}
    for row in timed:
        assert set(row.ms) == set(race.scenarios) and row.rounds >= 3 and row.compile_s > 0
        assert row.score_ms is not None and row.score_ms > 0
    # the winner is the fastest timed row that was not rejected by the accuracy guard
    assert race.chosen is not None
    passing = [r for r in race.ranked() if r.status != REJECTED]
    assert race.chosen is passing[0]
    assert race.summary().startswith(f"raced: {race.chosen.label()}")
    # the repository loads what the race chose, with its layout, and says why in the served config
    config = parse_pbtxt(model / "config.pbtxt")
    choice = selector.choose("wide", model, model / "1", config)
    assert (choice.backend_name, choice.options.precision) == (race.chosen.backend, race.chosen.precision)
    assert (choice.instances, choice.options.threads) == (race.chosen.instances, race.chosen.threads)
    assert ": raced: " in choice.reason and choice.shown["runtime_choice"] == choice.reason
    prepared = prepare_version(
        selector, "wide", model, 1, model / "1", config, str(model / "config.pbtxt"), 4
    )
    try:
        assert prepared.config.parameters["runtime_choice"].string_value.startswith("device profile")
        assert len(prepared.instances) == race.chosen.instances
        assert sum(g.count for g in prepared.config.instance_group) == race.chosen.instances
    finally:
        for instance in prepared.instances:
            instance.close()


def test_an_unavailable_runtime_is_not_raced(model: Path, tmp_path: Path) -> None:
    race = _race(_selector(tmp_path, runtimes=("onnxruntime",)), model)
    assert race is not None and race.chosen is not None and race.chosen.backend == "onnxruntime"
    openvino = [r for r in race.rows if r.backend == "openvino"]
    assert openvino and all(r.status == REJECTED and "not installed" in r.reason for r in openvino)


def test_a_tiny_budget_falls_back_to_the_rule_and_says_so(model: Path, tmp_path: Path) -> None:
    selector = _selector(tmp_path, budget=0.001)
    race = _race(selector, model)
    assert race is not None and race.chosen is None
    assert race.fallback is not None and race.fallback.startswith("over budget")
    assert "no evidence to compare" in race.fallback and not race.final  # the background race goes on
    assert len([r for r in race.rows if r.score_ms is not None]) <= 1  # at most the rule's, warmed up
    assert any(r.status == OVER_BUDGET and "budget" in r.reason for r in race.rows)
    choice = selector.choose("wide", model, model / "1", parse_pbtxt(model / "config.pbtxt"))
    rule = selector.plan("wide", model / "1", parse_pbtxt(model / "config.pbtxt")).chosen
    assert rule is not None and choice.backend_name == rule.option.backend
    assert "race fell back to the rule: over budget" in choice.reason and choice.instances == 0
    assert "provisional" in choice.reason and choice.shown["runtime_choice_final"] == "false"


def test_budget_zero_does_not_race(model: Path, tmp_path: Path) -> None:
    assert _race(_selector(tmp_path, budget=0), model) is None  # a pinned backend is raced: test_race_pins.py


def test_a_restart_reads_the_cache_without_timing(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _race(_selector(tmp_path), model)
    assert first is not None and first.chosen is not None
    files = list((tmp_path / "state" / "cache" / "race").glob("*.json"))
    assert len(files) == 1

    again = _selector(tmp_path)  # a new process would build a new selector

    def no_timing(*args: object, **kwargs: object) -> RaceResult:
        raise AssertionError("raced again although the result is cached")

    monkeypatch.setattr(again.racer, "_race", no_timing)
    cached = _race(again, model)
    assert cached is not None and cached.cached and cached.chosen is not None
    assert cached.chosen.label() == first.chosen.label()
    assert "cached" in cached.summary()


def test_a_corrupt_or_unwritable_cache_never_fails_a_load(model: Path, tmp_path: Path) -> None:
    selector = _selector(tmp_path)
    first = _race(selector, model)
    assert first is not None
    (file,) = (tmp_path / "state" / "cache" / "race").glob("*.json")
    file.write_text("{ this is not json")
    again = _race(_selector(tmp_path), model)
    assert again is not None and not again.cached and again.chosen is not None  # raced again
    json.loads(file.read_text())  # and the file is whole again
    entries = json.loads(file.read_text())
    for key in entries:
        entries[key]["rows"] = [{"nonsense": 1}]
    file.write_text(json.dumps(entries))
    assert RaceCache(tmp_path / "state" / "cache").get("0" * 64, "x") is None
    third = _race(_selector(tmp_path), model)
    assert third is not None and not third.cached  # a malformed entry is raced again
    # a cache folder that cannot be written (a file in its way): the race still answers
    blocked = RaceCache(tmp_path / "blocked")
    (tmp_path / "blocked").write_text("a file, not a folder")
    blocked.put("a" * 64, "k", third)
    assert blocked.get("a" * 64, "k") is None


def test_detect_model_prints_the_race_table(model: Path, tmp_path: Path) -> None:
    env = {"EDGESERVE_SERVER_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", "detect", "--model", str(model)],
        capture_output=True, text=True, cwd=ROOT, timeout=180, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "race (" in out and "WINNER" in out and "=> raced:" in out, out
    assert "1 in flight" in out and "batch 4 x instances" in out
    assert "onnxruntime fp32 1x" in out and "openvino fp32 1x" in out
    second = subprocess.run(
        [sys.executable, "-m", "edgeserve", "detect", "--model", str(model), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=180, env=env,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    data = json.loads(second.stdout)
    assert data["cached"] is True and data["race"]["winner"] is not None
    rows = data["race"]["rows"]
    winner = rows[data["race"]["winner"]]
    winner_label = RaceResult.from_dict(data["race"]).rows[data["race"]["winner"]].label()
    timed = [r for r in rows if r["score_ms"] is not None and r["status"] != REJECTED]
    assert winner["score_ms"] == min(r["score_ms"] for r in timed)
    assert {r["status"] for r in rows} <= {TIMED, REJECTED, OVER_BUDGET, "failed", "skipped"}
    assert data["plan"]["chosen"]["backend"] in ("onnxruntime", "openvino")
    # plain `detect` shows the cached race of each model (and races nothing itself)
    plain = subprocess.run(
        [sys.executable, "-m", "edgeserve", "detect", "--model-repository", str(model.parent)],
        capture_output=True, text=True, cwd=ROOT, timeout=180, env=env,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert "race     raced: " in plain.stdout and "; cached; " in plain.stdout
    # the plan says whether it is final and what it rests on
    assert ("; cached; final" in plain.stdout) is data["race"]["plan"]["final"], plain.stdout
    assert data["race"]["plan"]["chosen"] == winner_label and data["race"]["plan"]["evidence"]


@pytest.mark.skipif(not probe_hardware("/").cpu.bf16, reason="this CPU has no native bf16")
def test_a_cached_lower_precision_winner_is_judged_again(model: Path, tmp_path: Path) -> None:
    """A tighter tolerance after the race: the cached bf16 winner is re-judged (from the guard's
    cache) and, failing, the model is raced again rather than served in bf16."""
    assert _race(_selector(tmp_path), model) is not None
    (file,) = (tmp_path / "state" / "cache" / "race").glob("*.json")
    entries = json.loads(file.read_text())
    (key,) = entries
    rows = entries[key]["rows"]
    bf16 = next(i for i, r in enumerate(rows) if r["precision"] == "bf16" and r["instances"])
    rows[bf16].update(status=TIMED, score_ms=1e-3, guarded=True, reason="")
    entries[key]["winner"], entries[key]["fallback"] = bf16, None
    file.write_text(json.dumps(entries))
    cached = _race(_selector(tmp_path), model)
    assert cached is not None and cached.cached and cached.chosen is not None
    assert cached.chosen.precision == "bf16"  # within the default tolerance: the cache stands
    tight = 'parameters { key: "accuracy_tolerance" value: { string_value: "1e-12" } }\n'
    (model / "config.pbtxt").write_text(CONFIG + tight)
    again = _race(_selector(tmp_path), model)
    assert again is not None and not again.cached
    assert again.chosen is None or again.chosen.precision != "bf16"


def test_race_budget_setting_is_validated(tmp_path: Path) -> None:
    from edgeserve.config import ConfigError, load_settings

    good = tmp_path / "good.toml"
    good.write_text("[runtime]\nrace_budget_s = 0\n")
    assert load_settings(good).runtime.race_budget_s == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nrace_budget_s = -1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: runtime.race_budget_s: must be 0"):
        load_settings(bad)


def test_detect_model_on_a_fixture_root_does_not_race(model: Path, tmp_path: Path) -> None:
    env = {"EDGESERVE_SERVER_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", "detect", "--root", str(ROOT / "devices/fixtures/x86-cpu"),
         "--model", str(model)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "race: not run (the probed root is not this machine)" in result.stdout
