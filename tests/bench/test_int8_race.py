"""What `tune --int8` says when an INT8 candidate passed the guard but does not serve: the race's winner
by name (bf16 wins on AMX / AVX512-BF16 CPUs as often as fp32), or that the race stopped before it measured
the INT8 candidates (--max-candidates), so a rerun continues; and the config stays on the winner."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from int8_cnn import write_repository

from edgeserve.bench.tune_int8 import ExtraModel, Int8Options, finish
from edgeserve.cli import main

FAST = ["--concurrency", "2", "--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "2"]


def test_a_race_cut_short_says_the_int8_candidates_were_not_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = write_repository(tmp_path / "repo").parent
    args = ["tune", "cnn", "--model-repository", str(repo), "--int8", "--out-dir", str(tmp_path / "out"),
            "--work-dir", str(tmp_path / "work"), "--int8-engines", "onnxruntime",
            "--backends", "onnxruntime", "--precisions", "fp32", "--max-candidates", "1", *FAST]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "int8 onnxruntime: kept" in captured.err
    assert "the race stopped before measuring them (run again to continue): the config serves " in out
    assert "onnxruntime fp32 1x2t mbs8" in out.split("the config serves ")[1].splitlines()[0]
    config = (tmp_path / "out" / "config.pbtxt").read_text()
    assert "model_int8" not in config and not (tmp_path / "out" / "model_int8.onnx").exists()

    # run again: fp32's result is reused and the INT8 candidate measured; whichever wins, it is said so
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "measured before (ok), skipped" in again or "1 from earlier runs" in again
    assert "stopped before measuring them" not in again
    assert "lost the race to onnxruntime fp32" in again or "the winner serves the INT8 model" in again


def test_the_winner_is_named_when_int8_lost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "config.pbtxt"
    output.write_text('name: "cnn"\n')
    extras = ["int8:aaaa", "int8-ir:bbbb"]

    def after_race(won: ExtraModel | None, winner: str, measured: set[str]) -> str:
        model_dir = tmp_path / "cnn"
        finish(
            won, extras, Int8Options(), output, model_dir, model_dir / "1", tmp_path, print, winner, measured
        )
        return capsys.readouterr().out

    said = after_race(None, "openvino bf16 1x2t mbs8", {"", "int8:aaaa"})
    assert "lost the race to openvino bf16 1x2t mbs8: the config serves that" in said
    assert "not measured yet: int8-ir (run again to continue)" in said
    said = after_race(None, "onnxruntime fp32 1x2t mbs8", {"", *extras})
    assert "lost the race to onnxruntime fp32 1x2t mbs8: the config serves that" in said
    assert "not measured" not in said
    # an INT8 winner: its file beside the config, nothing about losing
    (tmp_path / "made").mkdir()
    made = Path(shutil.copy(output, tmp_path / "made" / "model_int8.onnx"))
    said = after_race(
        ExtraModel("int8:aaaa", {"1/model_int8.onnx": made}), "onnxruntime int8-model", set(extras)
    )
    assert "lost the race" not in said and "the winner serves the INT8 model" in said
    assert (tmp_path / "model_int8.onnx").is_file()
