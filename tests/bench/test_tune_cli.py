"""`edgeserve tune` on the sample MLP: a few candidates within a small time, the config.pbtxt it writes
loads in edgeserve, and a second run resumes (skips what the first measured)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from es_server import ROOT, start_server
from onnx_models import write_model

from edgeserve.cli import main

FAST = ["--concurrency", "2", "--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "2"]


def test_tune_writes_a_loadable_config_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tune"
    samples = tmp_path / "samples"  # the sample MLP (its builder and config)
    config = (ROOT / "models" / "mlp" / "config.pbtxt").read_text()
    model_dir = write_model(samples, "mlp", "mlp", config=config)
    args = [
        "tune",
        "mlp",
        "--model-repository",
        str(samples),
        "--latency-budget-ms",
        "1000",
        "--out-dir",
        str(out),
        "--max-seconds",
        "60",
        *FAST,
    ]
    assert main([*args, "--max-candidates", "2"]) == 0
    first = capsys.readouterr()
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in records] == ["onnxruntime fp32 1x2t mbs8", "openvino fp32 1x2t mbs8"]
    assert all(r["status"] == "ok" and r["points"] for r in records), records
    assert records[1]["accuracy"]["max_err_over_range"] < 1e-3  # checked against the ORT fp32 reference
    assert "frontier" in first.out and "<- best within budget" in first.out
    assert "candidate 1: onnxruntime fp32 1x2t mbs8" in first.err  # progress on stderr
    config = (out / "config.pbtxt").read_text()
    assert config.startswith("# Written by `edgeserve tune`") and 'name: "mlp"' in config
    assert "intra_op_thread_count" in config or "INFERENCE_NUM_THREADS" in config

    # again: the two finished candidates are skipped, the next one is measured
    assert main([*args, "--max-candidates", "1"]) == 0
    second = capsys.readouterr()
    assert second.err.count("measured before (ok), skipped") == 2
    assert "1 candidate(s) measured now, 2 from earlier runs" in second.out
    assert len((out / "results.jsonl").read_text().splitlines()) == 3

    # the written config serves in edgeserve
    repo = tmp_path / "repo"
    (repo / "mlp").mkdir(parents=True)
    (repo / "mlp" / "1").symlink_to(model_dir / "1")
    (repo / "mlp" / "config.pbtxt").write_text((out / "config.pbtxt").read_text())
    server = start_server(repo, tmp_path, args=["--load-model", "mlp", "--log-level", "WARNING"])
    try:
        body = json.dumps(
            {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
        )
        request = urllib.request.Request(
            server.base + "/v2/models/mlp/infer", data=body.encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert len(json.loads(response.read())["outputs"][0]["data"]) == 4
    finally:
        server.stop()


def test_tune_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "nothing", "--model-repository", str(tmp_path), "--latency-budget-ms", "5"]) == 2
    assert "edgeserve tune: model 'nothing'" in capsys.readouterr().err
    write_model(tmp_path, "mlp", "mlp")
    assert main(["tune", "mlp", "--model-repository", str(tmp_path), "--latency-budget-ms", "0"]) == 2


def test_int8_model_candidate_is_checked_and_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quantized model made elsewhere (ONNX Runtime dynamic quantization here) joins the search,
    served from the file sent with the load request, held to the fp32 reference."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    samples = tmp_path / "samples"
    model_dir = write_model(
        samples, "mlp", "mlp", config=(ROOT / "models" / "mlp" / "config.pbtxt").read_text()
    )
    int8 = tmp_path / "mlp_int8.onnx"
    quantize_dynamic(str(model_dir / "1" / "model.onnx"), str(int8), weight_type=QuantType.QInt8)
    out = tmp_path / "tune"
    args = ["tune", "mlp", "--model-repository", str(samples), "--latency-budget-ms", "1000", "--out-dir",
            str(out), "--backends", "onnxruntime", "--precisions", "fp32", "--int8-model", str(int8),
            "--max-candidates", "2", *FAST]  # fmt: skip
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in records] == ["onnxruntime fp32 1x2t mbs8", "onnxruntime int8-model 1x2t mbs8"]
    int8_record = records[1]
    assert int8_record["status"] in ("ok", "rejected"), int8_record
    accuracy = int8_record["accuracy"]
    assert 0 < accuracy["max_err_over_range"] < 0.5 and accuracy["cosine_min"] > 0.9
    if int8_record["status"] == "ok":
        assert int8_record["points"]
    assert "int8-model" in capsys.readouterr().out
