"""ModelRepository on real models, real backends and the real scheduler: start, lookups, index,
version policies, broken models, control modes, the data plane on top."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx_models import write_model
from repo_helpers import RepoFactory, infer

from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends.base import BackendOptions
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InputTensor
from edgeserve.repository.selection import BackendChoice, DefaultSelector
from edgeserve.server.dataplane import DataPlane

CONV_CONFIG = """
name: "conv"
backend: "onnxruntime"
max_batch_size: 2
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "features" data_type: TYPE_FP32 dims: [ 4, -1, -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def _ort_reference(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return ortb.BACKEND.load(path, None, BackendOptions()).infer(inputs)


async def test_start_serves_a_folder_with_only_model_onnx(
    tmp_path: Path, make_repo: RepoFactory, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(tmp_path / "models", "mlp")
    write_model(tmp_path / "models", "conv", "conv", config=CONV_CONFIG)
    repo = make_repo(tmp_path / "models")
    assert not repo.all_ready()
    with caplog.at_level(logging.INFO, logger="edgeserve.repository"):
        await repo.start()
    assert repo.all_ready()
    assert [(e["name"], e["version"], e["state"]) for e in repo.index()] == [
        ("conv", "1", "READY"), ("mlp", "1", "READY"),
    ]  # fmt: skip
    mlp = repo.get("mlp")
    assert mlp.version == 1 and mlp.backend_name == "openvino" and mlp.platform == "openvino"
    assert mlp.config.max_batch_size == 4 and list(mlp.config.input[0].dims) == [16]
    assert mlp.config.HasField("dynamic_batching") and mlp.io.inputs[0].shape == (-1, 16)
    assert mlp.model_dir == tmp_path / "models" / "mlp"
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    out = await infer(mlp, {"INPUT0": x})
    ref = _ort_reference(tmp_path / "models" / "mlp" / "1" / "model.onnx", {"INPUT0": x})
    np.testing.assert_allclose(out["OUTPUT0"], ref["OUTPUT0"], rtol=1e-5, atol=1e-5)

    conv = repo.get("conv", "1")
    assert conv.backend_name == "onnxruntime" and len(conv.instances) == 2
    assert conv.platform == "onnxruntime_onnx"  # auto-completed from the backend
    images = np.ones((2, 3, 5, 7), np.float32)
    assert (await infer(conv, {"images": images}))["features"].shape == (2, 4, 5, 7)
    messages = [r.getMessage() for r in caplog.records]
    assert "model mlp version 1 loading" in messages
    assert any(m.startswith("model mlp version 1 ready in ") and "backend=openvino" in m for m in messages)
    assert [m.name for m in repo.served()] == ["conv", "mlp"]
    assert repo.config("conv").name == "conv"


async def test_lookup_errors(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    repo = make_repo(tmp_path / "models")
    await repo.start()
    cases = [
        (("nope", ""), Status.NOT_FOUND, "Request for unknown model: 'nope' is not found"),
        (("nope", "1"), Status.NOT_FOUND, "Request for unknown model: 'nope' is not found"),
        (("mlp", "7"), Status.NOT_FOUND, "Request for unknown model: 'mlp' version 7 is not found"),
        (("mlp", "x"), Status.INVALID_ARG, "'x' is not a number"),
    ]
    for (name, version), status, text in cases:
        with pytest.raises(InferenceError) as err:
            repo.get(name, version)
        assert err.value.status is status and text in err.value.message
        assert not repo.is_ready(name, version)
    assert repo.is_ready("mlp") and repo.is_ready("mlp", "1")
    await repo.unload("mlp")
    with pytest.raises(InferenceError) as err:
        repo.get("mlp", "1")
    assert err.value.status is Status.UNAVAILABLE
    assert err.value.message == "Request for unknown model: 'mlp' version 1 is not at ready state"
    with pytest.raises(InferenceError) as latest:
        repo.get("mlp")
    assert latest.value.status is Status.UNAVAILABLE
    assert repo.index() == [{"name": "mlp", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert repo.index(ready_only=True) == []


async def test_broken_models_are_isolated(tmp_path: Path, make_repo: RepoFactory,
                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    models = tmp_path / "models"
    write_model(models, "good")
    garbage = models / "garbage" / "1" / "model.onnx"
    garbage.parent.mkdir(parents=True)
    garbage.write_bytes(b"not an onnx file")
    write_model(models, "badcfg", config='name: "badcfg"\nmax_batch: 4\n')
    write_model(
        models, "toobig", config="max_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 16 ] }\n"
    )
    (models / "empty").mkdir()
    repo = make_repo(models)
    with caplog.at_level(logging.INFO, logger="edgeserve.repository"):
        await repo.start()
    assert repo.is_ready("good") and [m.name for m in repo.served()] == ["good"]
    assert not repo.all_ready()  # strict readiness: a model that was asked for is down
    index = {e["name"]: e for e in repo.index()}
    assert index["good"]["state"] == "READY"
    for name in ("garbage", "badcfg", "toobig", "empty"):
        assert index[name]["state"] == "UNAVAILABLE", index[name]
    assert str(garbage) in index["garbage"]["reason"]
    assert "config.pbtxt" in index["badcfg"]["reason"] and "max_batch" in index["badcfg"]["reason"]
    assert "dynamic_batching.preferred_batch_size: 16 exceeds max_batch_size 8" in index["toobig"]["reason"]
    assert "no version folder" in index["empty"]["reason"]
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(m.startswith("model garbage version 1 failed: ") for m in failed)
    with pytest.raises(InferenceError) as err:
        repo.get("garbage")
    assert err.value.status is Status.UNAVAILABLE


async def test_version_policies(tmp_path: Path, make_repo: RepoFactory) -> None:
    models = tmp_path / "models"
    for version in (1, 2, 3):
        write_model(models, "latest2", version=version, seed=version,
                    config="version_policy { latest { num_versions: 2 } }")  # fmt: skip
        write_model(models, "every", version=version, config="version_policy { all { } }")
        write_model(
            models, "pick", version=version, config="version_policy { specific { versions: [ 1, 4 ] } }"
        )
        write_model(models, "default", version=version)
    repo = make_repo(models)
    await repo.start()
    assert [m.version for m in repo.ready_versions("latest2")] == [2, 3]
    assert repo.get("latest2").version == 3 and repo.get("latest2", "2").version == 2
    assert not repo.is_ready("latest2", "1")
    assert [m.version for m in repo.ready_versions("every")] == [1, 2, 3]
    assert [m.version for m in repo.ready_versions("default")] == [3]
    assert [m.version for m in repo.ready_versions("pick")] == [1]
    pick = {e["version"]: e for e in repo.index() if e["name"] == "pick"}
    assert pick["1"]["state"] == "READY" and pick["4"]["state"] == "UNAVAILABLE"
    assert "version folder 4" in pick["4"]["reason"]
    x = np.ones((1, 16), np.float32)
    v2 = await infer(repo.get("latest2", "2"), {"INPUT0": x})
    v3 = await infer(repo.get("latest2", "3"), {"INPUT0": x})
    assert not np.allclose(v2["OUTPUT0"], v3["OUTPUT0"])  # different weights per version


async def test_explicit_mode_loads_only_what_is_asked(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "a")
    write_model(tmp_path / "models", "b")
    repo = make_repo(tmp_path / "models", load_models=["b", "ghost"])
    await repo.start()
    index = {e["name"]: e for e in repo.index()}
    assert index["a"] == {"name": "a", "version": "", "state": "", "reason": ""}  # in the repo, not loaded
    assert index["b"]["state"] == "READY"
    assert index["ghost"]["state"] == "UNAVAILABLE" and "no folder 'ghost'" in index["ghost"]["reason"]
    await repo.load("a")
    assert repo.is_ready("a")
    with pytest.raises(InferenceError) as err:
        await repo.load("ghost")
    assert err.value.status is Status.NOT_FOUND
    with pytest.raises(InferenceError):
        await repo.load("../etc")
    with pytest.raises(InferenceError) as unknown:
        await repo.unload("never-heard-of")
    assert unknown.value.status is Status.NOT_FOUND


async def test_mode_none_loads_everything(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "a")
    write_model(tmp_path / "models", "b")
    repo = make_repo(tmp_path / "models", load_models=[], mode="none")
    await repo.start()
    assert sorted(m.name for m in repo.served()) == ["a", "b"] and repo.all_ready()


async def test_missing_repository_serves_nothing(tmp_path: Path, make_repo: RepoFactory) -> None:
    repo = make_repo(tmp_path / "nowhere")
    await repo.start()
    assert repo.index() == [] and repo.served() == [] and repo.all_ready()


async def test_bytes_model_with_warmup_falls_back_to_onnxruntime(
    tmp_path: Path, make_repo: RepoFactory
) -> None:
    config = """
    max_batch_size: 2
    model_warmup [
      { name: "zeros" batch_size: 2 inputs { key: "INPUT0" value: { data_type: TYPE_STRING dims: [ 3 ] zero_data: true } } },
      { name: "random" batch_size: 1 count: 2
        inputs { key: "INPUT0" value: { data_type: TYPE_STRING dims: [ 3 ] random_data: true } } }
    ]
    """  # noqa: E501
    write_model(tmp_path / "models", "text", "identity", config=config, datatype="BYTES", shape=["N", 3])
    repo = make_repo(tmp_path / "models")
    await repo.start()
    served = repo.get("text")
    assert served.backend_name == "onnxruntime"  # openvino, tried first, refuses string tensors
    assert served.config.input[0].data_type == 13  # TYPE_STRING
    x = np.array([[b"a", b"bc", "d\u00e9".encode()]], dtype=np.object_)
    assert (await infer(served, {"INPUT0": x}))["OUTPUT0"].tolist() == x.tolist()


class RecordingSelector:
    """An injected selector (the hardware engineer's will look like this): always ONNX Runtime."""

    def __init__(self, settings: Any) -> None:
        self.inner = DefaultSelector(settings, cpus=4)
        self.calls: list[tuple[str, int]] = []

    def choose(self, model_name: str, model_dir: Path, version_dir: Path, config: Any) -> BackendChoice:
        self.calls.append((model_name, int(version_dir.name)))
        return BackendChoice(
            "onnxruntime", version_dir / "model.onnx", BackendOptions(threads=2), "test selector"
        )


async def test_injected_selector(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    probe = make_repo(tmp_path / "models")
    selector = RecordingSelector(probe.settings)
    repo = make_repo(tmp_path / "models", selector=selector)
    await repo.start()
    served = repo.get("mlp")
    assert selector.calls == [("mlp", 1)]
    assert served.backend_name == "onnxruntime" and served.config.backend == "onnxruntime"
    assert served.config.platform == "onnxruntime_onnx" and served.choice_reason == "test selector"


async def test_data_plane_on_top(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    repo = make_repo(tmp_path / "models")
    await repo.start()
    shm = SharedMemoryRegistry(True, [], 8)
    try:
        plane = DataPlane(repo, shm)
        assert plane.ready() and plane.model_ready("mlp")
        meta = plane.model_metadata("mlp")
        assert meta["versions"] == ["1"] and meta["inputs"][0]["shape"] == [-1, 16]
        x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
        request = InferRequest("mlp", inputs=[InputTensor("INPUT0", "FP32", (2, 16), x)])
        response = await plane.infer(request)
        assert response.model_version == "1" and response.outputs[0].name == "OUTPUT0"
        ref = _ort_reference(tmp_path / "models" / "mlp" / "1" / "model.onnx", {"INPUT0": x})
        np.testing.assert_allclose(response.outputs[0].data, ref["OUTPUT0"], rtol=1e-5, atol=1e-5)
        stats = plane.statistics("mlp")["model_stats"]
        assert stats[0]["name"] == "mlp" and stats[0]["version"] == "1"
        await plane.unload_model("mlp")
        with pytest.raises(InferenceError) as err:
            await plane.infer(InferRequest("mlp", inputs=[InputTensor("INPUT0", "FP32", (2, 16), x)]))
        assert err.value.status is Status.UNAVAILABLE
    finally:
        shm.close()
