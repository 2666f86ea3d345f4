"""`edgeserve tune MODEL --int8` on a small real CNN: calibrated from its model_warmup files, kept past the
accuracy guard on held-out rows, raced, applied into the model folder where the runtime plan picks it,
shipped in a signed bundle with its calibration samples; a candidate that fails the guard is rejected
with the reason and nothing is written; a folder of .npy/.npz/PNG samples; resume after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from es_server import ROOT
from int8_cnn import clear_inputs, write_repository

from edgeserve.bench import calibration
from edgeserve.bench.int8 import WorkDir, quantize_ort, scheme_for
from edgeserve.bench.tune_int8 import Int8Options, calibrate
from edgeserve.cli import main

FAST = ["--concurrency", "2", "--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "2"]
# --precisions int8: only the INT8 candidates race (the winner is then INT8 whatever the timings)
ONLY_INT8 = ["--backends", "onnxruntime", "--precisions", "int8", "--max-candidates", "1"]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("int8") / "repo").parent


def _copy(template: Path, tmp: Path) -> Path:
    repo = tmp / "repo"
    shutil.copytree(template, repo)
    return repo


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _args(repo: Path, tmp: Path, *extra: str) -> list[str]:
    return ["tune", "cnn", "--model-repository", str(repo), "--int8", "--out-dir", str(tmp / "out"),
            "--work-dir", str(tmp / "work"), "--int8-engines", "onnxruntime", *FAST, *extra]  # fmt: skip


def test_int8_from_warmup_passes_the_guard_is_applied_and_bundled(
    template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = _copy(template, tmp_path)
    assert main(_args(repo, tmp_path, *ONLY_INT8, "--apply")) == 0
    out = capsys.readouterr()
    assert "from model_warmup input_data_file data (16 rows)" in out.err
    assert "calibration batch 2/2" in out.err  # 12 rows in batches of 8: progress per batch
    assert "int8 onnxruntime: kept: top-1 100.0%" in out.err and "on 4 held-out rows" in out.err
    record = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[0])
    assert record["label"] == "onnxruntime int8-model 1x2t mbs8" and record["status"] == "ok"
    assert record["accuracy"]["note"].startswith("int8 guard: top-1 100.0%") and record["points"]

    # a real QDQ model with int8 weights, the same file in the results, beside the config, in the model
    installed = repo / "cnn" / "1" / "model_int8.onnx"
    graph = onnx.load(str(installed)).graph
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"} <= {n.op_type for n in graph.node}
    assert any(t.data_type == onnx.TensorProto.INT8 for t in graph.initializer)
    digest = hashlib.sha256(installed.read_bytes()).hexdigest()
    for copy in (tmp_path / "out" / "int8" / "model_int8.onnx", tmp_path / "out" / "model_int8.onnx"):
        assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest
    assert 'default_model_filename: "model_int8.onnx"' in (repo / "cnn" / "config.pbtxt").read_text()
    assert "model_warmup" in (tmp_path / "out" / "config.pbtxt.before").read_text()
    assert not list((tmp_path / "work").rglob("*.onnx"))  # the work folder is gone once done
    assert not list(repo.rglob(".*.tmp"))

    # the runtime plan serves the INT8 file
    assert main(["detect", "--model-repository", str(repo), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["models"][0]
    assert plan["chosen"]["artifact"] == "model_int8.onnx" and plan["chosen"]["backend"] == "onnxruntime"

    # a second run reuses the calibrated model (same model, samples, scheme) instead of calibrating again
    assert main(_args(repo, tmp_path, *ONLY_INT8)) == 0
    again = capsys.readouterr()
    assert "calibrated by an earlier run" in again.err and "calibration batch" not in again.err

    # the bundle carries the INT8 model and calibration samples, signed like every file
    samples = tmp_path / "samples"
    samples.mkdir()
    np.save(samples / "crops.npy", clear_inputs(repo / "cnn" / "1" / "model.onnx", 4, seed=3))
    bundle = tmp_path / "cnn.esb"
    assert main(["keygen", "--out", str(tmp_path / "keys")]) == 0
    assert main(["bundle", "build", str(repo), "--name", "cnn", "--version", "1", "--key",
                 str(tmp_path / "keys" / "edgeserve.key"), "--out", str(bundle),
                 "--calibration", f"cnn={samples}"]) == 0  # fmt: skip
    capsys.readouterr()
    trust = tmp_path / "trust"
    trust.mkdir()
    shutil.copy(tmp_path / "keys" / "edgeserve.pub", trust)
    assert main(["bundle", "inspect", str(bundle), "--json"]) == 0
    files = {f["path"]: f for f in json.loads(capsys.readouterr().out)["manifest"]["files"]}
    assert files["models/cnn/1/model_int8.onnx"]["sha256"] == digest
    assert "models/cnn/calibration/crops.npy" in files
    assert main(["bundle", "verify", str(bundle), "--trust", str(trust)]) == 0
    assert f"{len(files)} files verified" in capsys.readouterr().out

    # on the device, the bundle's samples are a calibration source
    from edgeserve.ota.archive import extract
    from edgeserve.ota.build import verify_bundle

    manifest, _ = verify_bundle(bundle, trust)
    extract(bundle, manifest, tmp_path / "installed")
    model_dir = tmp_path / "installed" / "models" / "cnn"
    found = calibration.collect(model_dir / "1" / "model.onnx", model_dir, None, "bundle", None, 0, 0.25)
    assert found.source == "cnn/calibration/ (4 rows)" and found.real
    assert len(found.calibration) == 3 and len(found.held_out) == 1


def test_int8_failing_the_guard_is_rejected_and_nothing_is_written(
    template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = _copy(template, tmp_path)
    before = _tree(repo)
    assert main(_args(repo, tmp_path, "--apply", "--int8-max-error", "1e-9")) == 1
    out = capsys.readouterr()
    assert "int8 onnxruntime: rejected by the accuracy guard: logits: RMS error" in out.err
    assert "no INT8 candidate passed the accuracy guard" in out.out and "nothing written" in out.out
    assert _tree(repo) == before
    assert not (tmp_path / "out" / "int8").exists() and not (tmp_path / "out" / "results.jsonl").exists()
    assert not (tmp_path / "out" / "config.pbtxt").exists()
    assert not any((tmp_path / "work").rglob("*"))  # the discarded candidate is not kept either


def test_calibration_from_a_folder_of_npy_npz_and_images(
    template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    model_dir = _copy(template, tmp_path) / "cnn"
    (model_dir / "config.pbtxt").write_text((model_dir / "config.pbtxt").read_text().split("model_warmup")[0])
    shutil.rmtree(model_dir / "warmup")
    data = clear_inputs(model_dir / "1" / "model.onnx", 14, seed=5)
    folder = tmp_path / "crops"
    folder.mkdir()
    np.save(folder / "a.npy", data[:6])  # a batch
    np.save(folder / "b.npy", data[6])  # one item, no batch axis
    np.savez(folder / "c.npz", x=data[7:11])
    for i in range(11, 14):
        pixels = np.round(data[i].transpose(1, 2, 0) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"d{i}.png")
    (folder / "README.txt").write_text("not a sample")

    options = Int8Options(source="auto", folder=folder, work_root=tmp_path / "work", engines=("onnxruntime",))
    say: list[str] = []
    extras = calibrate(options, model_dir, model_dir / "1", tmp_path / "out", False, say.append)
    assert any("from folder" in line and "(14 rows)" in line for line in say), say
    assert [e.tag.split(":")[0] for e in extras] == ["int8"] and "top-1 100.0%" in (extras[0].note or "")

    # without a folder and without warm-up samples: a clear refusal
    with pytest.raises(Exception, match="no calibration samples for cnn"):
        calibrate(Int8Options(), model_dir, model_dir / "1", tmp_path / "out2", False, say.append)


def test_calibration_ranges_survive_an_interruption_after_calibrating(template: Path, tmp_path: Path) -> None:
    """Killed after the ranges were saved but before the model was: the next run does not calibrate."""
    model = template / "cnn" / "1" / "model.onnx"
    rows = calibration._rows({"x": clear_inputs(model, 8, seed=9)}, calibration.onnx_inputs(model), "test")
    samples = calibration.Samples(rows[:6], rows[6:], "test", True)
    scheme = scheme_for(set(), "x86_64")  # no VNNI: reduce_range
    assert scheme.reduce_range and scheme.activations == "uint8"
    first: list[str] = []
    with WorkDir(tmp_path / "cache", "k") as work:
        done = quantize_ort(model, samples, scheme, work, 4, "minmax", True, first.append)
        done.unlink()  # as if killed between the two steps
        again: list[str] = []
        assert quantize_ort(model, samples, scheme, work, 4, "minmax", True, again.append).is_file()
    assert any("calibration batch 2/2" in line for line in first)
    assert any("calibration ranges of an interrupted run found: resumed" in line for line in again)
    assert not any("calibration batch" in line for line in again)


def test_a_killed_calibration_leaves_nothing_half_written_and_the_rerun_completes(
    template: Path, tmp_path: Path
) -> None:
    repo = _copy(template, tmp_path)
    folder = tmp_path / "many"
    folder.mkdir()
    np.save(folder / "rows.npy", np.random.default_rng(0).random((960, 3, 32, 32), dtype=np.float32))
    before = _tree(repo)
    args = [
        sys.executable,
        "-m",
        "edgeserve",
        *_args(repo, tmp_path, *ONLY_INT8, "--apply"),
        "--calibration",
        str(folder),
        "--calibration-batch",
        "1",
        "--calibration-samples",
        "960",
        "--int8-min-top1",
        "0.5",
        "--int8-max-error",
        "0.2",
    ]  # fmt: skip  (random rows: near ties are allowed to flip here)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert process.stderr is not None
    try:
        for line in process.stderr:
            # the first tenth of 720 batches (about a second of calibration): SIGKILL mid-calibration
            if "calibration batch" in line:
                process.send_signal(signal.SIGKILL)
                break
    finally:
        process.kill()
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    work = next((tmp_path / "work" / "int8").iterdir())
    assert (work / "tmp").is_dir() and not list(work.glob("ranges-*.json"))  # it died calibrating
    assert _tree(repo) == before  # the repository was not touched
    assert not (tmp_path / "out" / "int8").exists()

    rerun = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "removed what an interrupted run left half-written" in rerun.stderr and "tmp" in rerun.stderr
    assert (repo / "cnn" / "1" / "model_int8.onnx").is_file() and not list(repo.rglob(".*.tmp"))
    assert not work.exists()


def test_nncf_quantized_openvino_ir_is_raced_and_applied(
    template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("nncf", reason="NNCF is an optional extra (pip install 'edgeserve[int8]')")
    repo = _copy(template, tmp_path)
    args = [*_args(repo, tmp_path, "--backends", "openvino", "--precisions", "int8", "--max-candidates", "1",
                   "--apply"), "--int8-engines", "nncf"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr()
    assert "openvino/nncf: calibrating on 12 rows" in out.err and "int8 nncf: kept: top-1 100.0%" in out.err
    record = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[0])
    assert record["label"] == "openvino int8-ir 1x2t mbs8" and record["status"] == "ok", record
    assert (repo / "cnn" / "1" / "model_int8.xml").is_file() and (
        repo / "cnn" / "1" / "model_int8.bin"
    ).is_file()
    assert 'default_model_filename: "model_int8.xml"' in (repo / "cnn" / "config.pbtxt").read_text()
    assert main(["detect", "--model-repository", str(repo), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["models"][0]
    assert plan["chosen"]["artifact"] == "model_int8.xml" and plan["chosen"]["backend"] == "openvino"


def test_a_resumed_file_that_changed_is_discarded_and_the_step_runs_again(
    template: Path, tmp_path: Path
) -> None:
    """The work folder lives in the cache: a finished step's file is reused only as edgeserve sealed it.
    Calibration ranges rewritten after the interruption are discarded, and the next run calibrates."""
    model = template / "cnn" / "1" / "model.onnx"
    rows = calibration._rows({"x": clear_inputs(model, 8, seed=9)}, calibration.onnx_inputs(model), "test")
    samples = calibration.Samples(rows[:6], rows[6:], "test", True)
    scheme = scheme_for(set(), "x86_64")
    with WorkDir(tmp_path / "cache", "k") as work:
        assert work.path.stat().st_mode & 0o777 == 0o700
        done = quantize_ort(model, samples, scheme, work, 4, "minmax", True, [].append)
        done.unlink()  # killed between the two steps ...
        [ranges] = work.path.glob("ranges-*.json")
        ranges.write_text(ranges.read_text().replace("1", "9"))  # ... and the ranges rewritten since
        again: list[str] = []
        assert quantize_ort(model, samples, scheme, work, 4, "minmax", True, again.append).is_file()
    assert not any("resumed" in line for line in again)
    assert any("calibration batch 2/2" in line for line in again)
