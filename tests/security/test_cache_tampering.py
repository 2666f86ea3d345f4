"""The cache folder, attacked: a member of the service group who can write into `<state_dir>/cache`
replaces what edgeserve reads back.

- A compiled OpenVINO model swapped for a valid blob of another model (same inputs and outputs: it would
  silently answer wrong) is not loaded: a real server discards it with a warning naming the file,
  compiles the model again, answers correctly, and the planted blob is gone.
- A race result rewritten to crown another candidate, or planted without a seal, is not believed: it is
  discarded and the model raced again.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from edgeserve.backends.cache import read_seal, seal_path, why_not_ours
from edgeserve.hardware.race_result import RaceCache, RaceResult, Row
from edgeserve.samples import build_mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from es_server import start_server

pytest.importorskip("openvino", reason="openvino is not installed")

CONFIG = """backend: "openvino"
max_batch_size: 8
input { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }
output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }
"""
X = np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32)
ATTACKER_UID = 65534


def _plant(path: Path, data: bytes) -> None:
    """Write `data` as the attacker would: their own file, renamed over ours (a group-writable folder
    lets them rename in it); as root the test can make it theirs, as another user it stays ours."""
    planted = path.with_name(".planted")
    planted.write_bytes(data)
    if os.geteuid() == 0:
        os.chown(planted, ATTACKER_UID, -1)
    os.replace(planted, path)


def _reference(model: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"INPUT0": X})[0])


def _infer(http_url: str) -> np.ndarray:
    with httpclient.InferenceServerClient(http_url) as client:
        tensor = httpclient.InferInput("INPUT0", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)
        return np.asarray(client.infer("mlp", [tensor]).as_numpy("OUTPUT0"))


def _foreign_blob(tmp_path: Path) -> bytes:
    """A genuine compiled blob of another model with the same signature (other weights)."""
    from edgeserve.backends import openvino as ovb

    other = build_mlp(tmp_path / "other" / "model.onnx", seed=99)
    compiled = ovb.core().compile_model(
        ovb.core().read_model(str(other)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    exported = compiled.export_model()
    return bytes(exported.getvalue() if hasattr(exported, "getvalue") else exported)


def test_a_swapped_openvino_blob_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model = build_mlp(repo / "mlp" / "1" / "model.onnx")
    (repo / "mlp" / "config.pbtxt").write_text(CONFIG)
    cache = tmp_path / "state" / "cache"
    env = {"EDGESERVE_RUNTIME_CACHE_DIR": str(cache)}
    expected = _reference(model)

    server = start_server(repo, tmp_path, env=env)
    try:
        np.testing.assert_allclose(_infer(server.http_url), expected, rtol=1e-5, atol=1e-6)
    finally:
        server.stop()
    # The backend is pinned, but the plan still races its layouts: one blob per layout raced. The attacker
    # swaps every one of them; whichever the restart serves must be rebuilt, not loaded.
    blobs = sorted((cache / "openvino").glob("*.ovblob"))
    assert blobs
    attack = _foreign_blob(tmp_path)
    for blob in blobs:
        _plant(blob, attack)

    server = start_server(repo, tmp_path, env=env)
    try:
        answer = _infer(server.http_url)
        log = server.log()
    finally:
        server.stop()
    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)  # the model's answers, not the blob's
    discarded = [blob for blob in blobs if f"discarding the compiled openvino model {blob}" in log]
    assert discarded and "rebuilt, not loaded" in log
    # each planted blob it met is gone: what lies there now is ours, sealed, and not the attacker's bytes
    for blob in discarded:
        assert blob.read_bytes() != attack and why_not_ours(blob.stat()) is None
        assert read_seal(blob)["ino"] == blob.stat().st_ino


def _race(winner: int) -> RaceResult:
    rows = [
        Row("onnxruntime", "CPU", "fp32", 1, 2, score_ms=1.0),
        Row("openvino", "CPU", "int8", 1, 2, score_ms=2.0),
    ]
    return RaceResult("mlp", ["1 in flight"], rows, winner=winner)


def test_a_rewritten_or_planted_race_result_is_not_believed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir, digest, key = tmp_path / "cache", "d" * 64, "race key"
    races = RaceCache(cache_dir)
    races.put(digest, key, _race(winner=0))
    file = races.cache.file(digest)
    assert file is not None and (got := races.get(digest, key)) is not None and got.winner == 0

    # the attacker crowns the int8 candidate (the accuracy guard's loser), keeping our seal beside it
    import json

    doctored = json.loads(file.read_text())
    doctored[key]["winner"] = 1
    _plant(file, json.dumps(doctored).encode())
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        assert races.get(digest, key) is None  # raced again, not believed
    assert f"discarding the race cache {file}" in caplog.text
    assert not file.exists() and not seal_path(file).exists()

    # a result planted where there was none (no seal of ours) is not believed either
    _plant(file, json.dumps({key: _race(winner=1).to_dict()}).encode())
    assert races.get(digest, key) is None and not file.exists()
