"""`edgeserve detect --root <fixture> [--json]` as a user runs it (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hw_helpers import FIXTURES, ROOT, make_repository


def _detect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeserve", "detect", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.parametrize("fixture", ["jetson-orin", "x86-cpu", "aws-inferentia"])
def test_detect_json(fixture: str, tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    result = _detect("--root", str(FIXTURES / fixture), "--model-repository", str(repo), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["profile"]["name"] == fixture
    assert data["accuracy_guard"] is False  # a fixture root is not this machine
    models = {m["model"]: m for m in data["models"]}
    assert set(models) == {"big", "tiny", "engine", "torch"}
    for model in models.values():
        assert all(r["reason"] for r in model["rejected"])
    if fixture == "jetson-orin":
        assert data["hardware"]["jetson"]["soc"] == "tegra234"
        assert models["big"]["chosen"]["backend"] == "tensorrt"
        assert models["torch"]["chosen"] is None
    if fixture == "aws-inferentia":
        assert models["torch"]["chosen"]["backend"] == "neuron"


def test_detect_human(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    result = _detect("--root", str(FIXTURES / "x86-intel-gpu-npu"), "--model-repository", str(repo))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "profile:  x86-intel-gpu-npu" in out
    assert "intel:    iGPU /dev/dri/renderD128 (i915), NPU /dev/accel/accel0 (intel_vpu)" in out
    assert "big v1: openvino device=GPU precision=fp16" in out
    assert "rejected openvino CPU bf16: this CPU has no native bf16" in out


def test_detect_bad_root(tmp_path: Path) -> None:
    result = _detect("--root", str(tmp_path / "missing"))
    assert result.returncode == 2 and "is not a folder" in result.stderr


def test_detect_lists_an_ensemble_with_its_steps(tmp_path: Path) -> None:
    repo = make_repository(tmp_path)
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 0\n'
        'input [{ name: "IN" data_type: TYPE_FP32 dims: [4] }]\n'
        'output [{ name: "OUT" data_type: TYPE_FP32 dims: [4] }]\n'
        "ensemble_scheduling { step [\n"
        '  { model_name: "tiny" model_version: -1 input_map { key: "x" value: "IN" }'
        ' output_map { key: "y" value: "MID" } },\n'
        '  { model_name: "big" model_version: -1 input_map { key: "x" value: "MID" }'
        ' output_map { key: "y" value: "OUT" } } ] }\n'
    )
    human = _detect("--root", str(FIXTURES / "x86-cpu"), "--model-repository", str(repo))
    assert human.returncode == 0, human.stderr
    assert "pipeline: ensemble of 2 steps (tiny -> big)" in human.stdout
    assert "ERROR" not in human.stdout
    data = json.loads(
        _detect("--root", str(FIXTURES / "x86-cpu"), "--model-repository", str(repo), "--json").stdout
    )
    assert data["ensembles"] == {"pipeline": ["tiny", "big"]} and data["errors"] == []
