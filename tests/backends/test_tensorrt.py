"""TensorRT backend: the pure parts (profile shapes, cache keys, engine cache, plan validity) run
everywhere; GPU paths run where `tensorrt` imports and a CUDA device answers, else skip with the reason."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx_models import build_conv_dynamic_hw, build_mlp
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends import trt_engine as te
from edgeserve.backends.base import BackendOptions
from edgeserve.backends.cache import Rejected
from edgeserve.backends.tensorrt import BACKEND, TensorRTBackend
from edgeserve.protocol.errors import InferenceError
from edgeserve.repository.config import parse_text

GPU_REASON = BACKEND.unavailable_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"TensorRT GPU path: {GPU_REASON}")
ORIN = te.DeviceIdentity("Orin", "8.7", "tegra234", "36.4.3")


def test_contract() -> None:
    assert (BACKEND.name, BACKEND.platforms, BACKEND.artifacts) == (
        "tensorrt",
        ("tensorrt_plan",),
        ("model.plan", "model.onnx"),
    )
    assert isinstance(BACKEND, TensorRTBackend)


def test_unavailable_reason_names_the_cause() -> None:
    if GPU_REASON is not None:
        assert any(word in GPU_REASON for word in ("tensorrt", "TensorRT", "CUDA", "cuda"))


def test_parse_shapes() -> None:
    assert te.parse_shapes("x:1x3x32x32, y:4") == {"x": (1, 3, 32, 32), "y": (4,)}
    assert te.parse_shapes("") == {}
    assert te.parse_shapes("ns/input:0:1x2") == {"ns/input:0": (1, 2)}
    with pytest.raises(ValueError):
        te.parse_shapes("x:1xA")
    with pytest.raises(ValueError):
        te.parse_shapes("nocolon")


def test_spec_from_config() -> None:
    config = parse_text(
        "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 2, 4 ] }\n"
        'parameters [ { key: "trt_profile_min_shapes" value: { string_value: "x:1x3x32x32" } },'
        '{ key: "trt_profile_opt_shapes" value: { string_value: "x:4x3x320x320" } },'
        '{ key: "trt_profile_max_shapes" value: { string_value: "x:8x3x640x640" } } ]',
        "t",
    )
    spec = te.spec_from_config(config, "fp16", "DLA:1")
    assert (spec.precision, spec.max_batch, spec.opt_batch, spec.dla_core) == ("fp16", 8, 4, 1)
    assert spec.max_shapes == {"x": (8, 3, 640, 640)}
    assert te.EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert te.spec_from_config(mc.ModelConfig(), "auto").precision == "fp16"


def test_derive_profile() -> None:
    spec = te.EngineSpec(max_batch=8, opt_batch=4)
    assert te.derive_profile({"INPUT0": (-1, 16)}, spec) == {"INPUT0": ((1, 16), (4, 16), (8, 16))}
    assert te.derive_profile({"x": (2, 16)}, te.EngineSpec()) == {"x": ((2, 16),) * 3}
    with pytest.raises(ValueError, match="trt_profile_min_shapes"):
        te.derive_profile({"images": (-1, 3, -1, -1)}, spec)
    explicit = te.EngineSpec(
        min_shapes={"images": (1, 3, 32, 32)},
        opt_shapes={"images": (1, 3, 320, 320)},
        max_shapes={"images": (4, 3, 640, 640)},
    )
    assert te.derive_profile({"images": (-1, 3, -1, -1)}, explicit)["images"][2] == (4, 3, 640, 640)
    with pytest.raises(ValueError, match="together"):
        te.derive_profile({"images": (-1, 3, -1, -1)}, te.EngineSpec(min_shapes={"images": (1, 3, 32, 32)}))
    bad = te.EngineSpec(min_shapes={"x": (1, 4)}, opt_shapes={"x": (1, 3)}, max_shapes={"x": (1, 3)})
    with pytest.raises(ValueError, match="min <= opt <= max"):
        te.derive_profile({"x": (1, 3)}, bad)


def test_cache_key_covers_what_makes_engines_unportable() -> None:
    spec = te.EngineSpec(precision="fp16", max_batch=4)
    key = te.cache_key("a" * 64, ORIN, "10.3.0", spec)
    assert key.startswith("sm87_trt10.3.0_fp16_")
    variants = [
        te.cache_key("b" * 64, ORIN, "10.3.0", spec),
        te.cache_key("a" * 64, te.DeviceIdentity("NVIDIA GeForce RTX 3080", "8.6"), "10.3.0", spec),
        te.cache_key("a" * 64, te.DeviceIdentity("Orin", "8.7", "tegra234", "36.3.0"), "10.3.0", spec),
        te.cache_key("a" * 64, ORIN, "10.7.0", spec),
        te.cache_key("a" * 64, ORIN, "10.3.0", te.EngineSpec(precision="fp32", max_batch=4)),
        te.cache_key("a" * 64, ORIN, "10.3.0", te.EngineSpec(precision="fp16", max_batch=8)),
        te.cache_key("a" * 64, ORIN, "10.3.0", te.EngineSpec(precision="fp16", max_batch=4, dla_core=0)),
    ]
    assert len({key, *variants}) == len(variants) + 1
    assert te.cache_key("a" * 64, ORIN, "10.3.0", te.EngineSpec(precision="fp16", max_batch=4)) == key


def test_engine_cache_and_plan_validity(tmp_path: Path) -> None:
    spec = te.EngineSpec()
    cache = te.EngineCache(tmp_path / "engines")
    expected = te.manifest_for("a" * 64, ORIN, "10.3.0", spec)
    key = te.cache_key("a" * 64, ORIN, "10.3.0", spec)
    assert cache.lookup(key, expected) is None
    built = tmp_path / "engines" / ".built.plan"
    te.write_private(built, b"engine bytes")  # as the build's child process writes it
    assert cache.store(key, built, expected) == b"engine bytes" and not built.exists()
    assert cache.plan_path(key).read_bytes() == b"engine bytes"
    assert cache.lookup(key, expected) == b"engine bytes"
    upgraded = te.manifest_for("a" * 64, ORIN, "10.7.0", spec)
    assert cache.lookup(key, upgraded) is None
    assert "TensorRT version differs" in (te.manifest_mismatch(expected, upgraded) or "")
    other_gpu = te.manifest_for("a" * 64, te.DeviceIdentity("RTX", "8.6"), "10.3.0", spec)
    assert "GPU differs" in (te.manifest_mismatch(expected, other_gpu) or "")
    (tmp_path / "engines" / f"{key}.json").write_text("{broken")
    assert cache.lookup(key, expected) is None


def test_a_replaced_engine_is_discarded_not_deserialized(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine is code: one edgeserve did not write (or that changed since) is never handed to
    TensorRT; a stand-in file plays the engine (deserializing needs a GPU)."""
    spec = te.EngineSpec()
    cache = te.EngineCache(tmp_path / "engines")
    expected = te.manifest_for("a" * 64, ORIN, "10.3.0", spec)
    key = te.cache_key("a" * 64, ORIN, "10.3.0", spec)
    built = tmp_path / "engines" / ".built.plan"
    te.write_private(built, b"engine bytes")
    cache.store(key, built, expected)
    planted = tmp_path / "engines" / "planted"
    planted.write_bytes(b"engine with a plugin that runs code")
    os.replace(planted, cache.plan_path(key))
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        assert cache.lookup(key, expected) is None
    assert f"discarding the cached TensorRT engine {cache.plan_path(key)}" in caplog.text
    assert not cache.plan_path(key).exists()
    # a build output someone else could write (group-writable) is refused, not cached
    loose = tmp_path / "engines" / ".loose.plan"
    loose.write_bytes(b"engine bytes")
    loose.chmod(0o660)
    with pytest.raises(Rejected, match="others can write it"):
        cache.store(key, loose, expected)
    assert not loose.exists() and not cache.plan_path(key).exists()
    # a name planted before the build is replaced, never written through
    trap = tmp_path / "engines" / ".trap.partial"
    trap.write_bytes(b"theirs")
    te.write_private(tmp_path / "engines" / ".trap.plan", b"ours")
    assert (tmp_path / "engines" / ".trap.plan").stat().st_mode & 0o777 == 0o600


def test_build_progress_and_failure_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent relays the child's lines, says "still building" during silence, and reports failures."""
    script = tmp_path / "fake_build.py"
    script.write_text(
        "import sys, time\nprint('phase Build: 1/2', flush=True)\ntime.sleep(0.5)\n"
        "open(sys.argv[-2], 'wb').write(b'plan')\nprint('phase Build: done', flush=True)\n"
    )
    real_popen = te.subprocess.Popen

    def popen(cmd: list[str], **kwargs: object) -> object:
        return real_popen([sys.executable, str(script), cmd[-2], cmd[-1]], **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(te.subprocess, "Popen", popen)
    monkeypatch.setattr(te, "STILL_BUILDING_EVERY_S", 0.2)
    lines: list[str] = []
    te.build_in_subprocess(tmp_path / "m.onnx", tmp_path / "out.plan", te.EngineSpec(), lines.append)
    assert (tmp_path / "out.plan").read_bytes() == b"plan"
    assert any("still building" in line for line in lines)
    # the child's lines in their order; a "still building" may come before the first of them when the
    # child takes longer than STILL_BUILDING_EVERY_S to start (a busy box)
    relayed = [line for line in lines if "still building" not in line]
    assert relayed[1] == "phase Build: 1/2" and lines[-1].startswith("engine for m.onnx built in")
    script.write_text("print('ONNX parse failed: bad node', flush=True)\nraise SystemExit(3)\n")
    with pytest.raises(RuntimeError, match=r"exit 3.*ONNX parse failed"):
        te.build_in_subprocess(tmp_path / "m.onnx", tmp_path / "none.plan", te.EngineSpec(), lines.append)


def test_inspect_onnx_without_tensorrt(tmp_path: Path) -> None:
    path = build_conv_dynamic_hw(tmp_path / "model.onnx")
    io = BACKEND.inspect(path)
    assert [(t.name, t.datatype, t.shape) for t in io.inputs] == [("images", "FP32", (-1, 3, -1, -1))]


@needs_gpu
def test_builds_caches_and_runs_an_engine(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "1" / "model.onnx")
    config = parse_text("max_batch_size: 8", "t")
    options = BackendOptions(device="GPU", precision="fp32", cache_dir=tmp_path / "engines")
    instance = BACKEND.load(path, config, options)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    out = instance.infer({"INPUT0": x})["OUTPUT0"]
    import onnxruntime as ort

    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"INPUT0": x})[0]
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-4)
    with pytest.raises(InferenceError, match="outside the engine's profile"):
        instance.infer({"INPUT0": np.zeros((9, 16), np.float32)})
    instance.close()
    assert len(list((tmp_path / "engines").glob("*.plan"))) == 1
    again = BACKEND.load(path, config, options)  # from the cache: no second build
    assert len(list((tmp_path / "engines").glob("*.plan"))) == 1
    again.close()


@needs_gpu
def test_foreign_plan_is_rebuilt_from_onnx(tmp_path: Path) -> None:
    build_mlp(tmp_path / "1" / "model.onnx")
    (tmp_path / "1" / "model.plan").write_bytes(b"not an engine")
    instance = BACKEND.load(
        tmp_path / "1" / "model.plan",
        parse_text("max_batch_size: 4", "t"),
        BackendOptions(device="GPU", precision="fp16", cache_dir=tmp_path / "engines"),
    )
    assert instance.fallback_reason and "rebuilt from model.onnx" in instance.fallback_reason
    instance.close()
