"""OpenVINO compiled models cached by edgeserve (backends/openvino_cache.py) on real models: imported
from a sealed blob the second time, keyed by what makes a blob unusable, rebuilt when tampered with."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx_models import build_mlp

pytest.importorskip("openvino", reason="openvino is not installed")

from edgeserve.backends import openvino as ovb
from edgeserve.backends.base import BackendOptions
from edgeserve.backends.cache import read_seal, seal_path

X = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)


def _options(cache: Path, precision: str = "fp32") -> BackendOptions:
    return BackendOptions(precision=precision, threads=1, cache_dir=cache)


def _blobs(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.ovblob"))


def test_second_load_imports_the_sealed_blob(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, cache = build_mlp(tmp_path / "m" / "1" / "model.onnx"), tmp_path / "cache"
    first = ovb.BACKEND.load(model, None, _options(cache))
    [blob] = _blobs(cache)
    assert blob.name.startswith("m-") and read_seal(blob)["size"] == blob.stat().st_size
    with caplog.at_level(logging.DEBUG, "edgeserve.backends.openvino"):
        second = ovb.BACKEND.load(model, None, _options(cache))
    assert f"imported from {blob}" in caplog.text
    np.testing.assert_array_equal(
        first.infer({"INPUT0": X})["OUTPUT0"], second.infer({"INPUT0": X})["OUTPUT0"]
    )
    assert int(second.compiled_property("INFERENCE_NUM_THREADS")) == 1  # load-time properties still apply


def test_the_key_covers_model_and_settings(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = build_mlp(tmp_path / "m" / "1" / "model.onnx")
    ovb.BACKEND.load(model, None, _options(cache))
    ovb.BACKEND.load(model, None, _options(cache, "fp16"))  # another precision: another blob
    assert len(_blobs(cache)) == 2
    build_mlp(model, seed=7)  # the same path, a new model (an update): never the old model's blob
    fresh = ovb.BACKEND.load(model, None, _options(cache))
    assert len(_blobs(cache)) == 3
    reference = ovb.BACKEND.load(model, None, BackendOptions(precision="fp32", threads=1))
    np.testing.assert_allclose(
        fresh.infer({"INPUT0": X})["OUTPUT0"], reference.infer({"INPUT0": X})["OUTPUT0"]
    )
    assert ovb.compile_properties(_options(cache), None).get("CACHE_DIR") is None


def test_a_blob_openvino_refuses_is_discarded_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sealed blob that still fails to import (an openvino upgrade the key missed): compiled again."""
    model, cache = build_mlp(tmp_path / "m" / "1" / "model.onnx"), tmp_path / "cache"
    ovb.BACKEND.load(model, None, _options(cache))
    [blob] = _blobs(cache)
    from edgeserve.backends.cache import write_sealed

    write_sealed(blob, b"\0" * 64)  # sealed by us, but not a blob
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        instance = ovb.BACKEND.load(model, None, _options(cache))
    assert f"discarding the compiled openvino model {blob}: openvino cannot import it" in caplog.text
    assert instance.infer({"INPUT0": X})["OUTPUT0"].shape == (2, 4)
    assert blob.stat().st_size > 64 and read_seal(blob)["size"] == blob.stat().st_size


def test_meta_devices_are_not_cached(tmp_path: Path) -> None:
    model, cache = build_mlp(tmp_path / "m" / "1" / "model.onnx"), tmp_path / "cache"
    ovb.BACKEND.load(model, None, BackendOptions(device="AUTO", precision="fp32", cache_dir=cache))
    assert _blobs(cache) == []


def test_a_blob_without_seal_is_not_imported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, cache = build_mlp(tmp_path / "m" / "1" / "model.onnx"), tmp_path / "cache"
    ovb.BACKEND.load(model, None, _options(cache))
    [blob] = _blobs(cache)
    seal_path(blob).unlink()  # what an older edgeserve (or anyone else) left: never imported
    with caplog.at_level(logging.DEBUG, "edgeserve"):
        ovb.BACKEND.load(model, None, _options(cache))
    assert "it has no seal" in caplog.text and "imported from" not in caplog.text
    assert read_seal(blob)["ino"] == blob.stat().st_ino  # compiled and sealed anew
