"""Run-time load / reload / unload: no lost requests, failed reloads keep the old version, warm-up
before READY, load-API configs and files, serialised lifecycle, close."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx_models import build_mlp, write_model
from repo_helpers import RepoFactory, infer, replace_file

from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends.base import BackendOptions
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository import warmup
from edgeserve.scheduling.job import Job


def _reference(path: Path, x: np.ndarray) -> np.ndarray:
    return ortb.BACKEND.load(path, None, BackendOptions()).infer({"INPUT0": x})["OUTPUT0"]


async def _traffic(repo: Any, name: str, x: np.ndarray, stop: asyncio.Event, results: list[np.ndarray],
                   errors: list[BaseException]) -> None:  # fmt: skip
    while not stop.is_set():
        try:
            results.append((await infer(repo.get(name), {"INPUT0": x}))["OUTPUT0"])
        except BaseException as exc:
            errors.append(exc)


async def test_reload_under_concurrent_traffic_loses_nothing(tmp_path: Path, make_repo: RepoFactory) -> None:
    models = tmp_path / "models"
    model_file = write_model(models, "mlp", seed=0) / "1" / "model.onnx"
    versions = [model_file.read_bytes(), build_mlp(tmp_path / "b.onnx", seed=1).read_bytes()]
    x = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    refs = [_reference(model_file, x), _reference(tmp_path / "b.onnx", x)]
    repo = make_repo(models)
    await repo.start()
    first = repo.get("mlp")
    stop = asyncio.Event()
    results: list[np.ndarray] = []
    errors: list[BaseException] = []
    clients = [asyncio.create_task(_traffic(repo, "mlp", x, stop, results, errors)) for _ in range(4)]
    await asyncio.sleep(0.2)
    for round_ in range(4):
        replace_file(model_file, versions[(round_ + 1) % 2])
        await repo.load("mlp")
        await asyncio.sleep(0.1)
        assert repo.all_ready()
    stop.set()
    await asyncio.gather(*clients)
    assert errors == []
    assert len(results) > 100
    for out in results:  # every answer came from one of the two models, never a broken one
        assert any(np.allclose(out, ref, rtol=1e-5, atol=1e-5) for ref in refs)
    final = await infer(repo.get("mlp"), {"INPUT0": x})
    np.testing.assert_allclose(final["OUTPUT0"], refs[0], rtol=1e-5, atol=1e-5)  # 4 rounds: back to the first
    assert repo.get("mlp") is not first
    with pytest.raises(InferenceError) as err:  # the first version is retired
        first.scheduler.submit(Job(inputs={"INPUT0": x}, batch_size=2, done=lambda result: None))
    assert err.value.status is Status.UNAVAILABLE


async def test_failed_reload_keeps_the_old_version(tmp_path: Path, make_repo: RepoFactory) -> None:
    models = tmp_path / "models"
    model_dir = write_model(models, "mlp")
    good = (model_dir / "1" / "model.onnx").read_bytes()
    repo = make_repo(models)
    await repo.start()
    old = repo.get("mlp")
    x = np.ones((1, 16), np.float32)
    stop = asyncio.Event()
    results: list[np.ndarray] = []
    errors: list[BaseException] = []
    client = asyncio.create_task(_traffic(repo, "mlp", x, stop, results, errors))

    replace_file(model_dir / "1" / "model.onnx", b"corrupt download")
    with pytest.raises(InferenceError) as broken:
        await repo.load("mlp")
    assert "model.onnx" in broken.value.message and "still serving version(s) 1" in broken.value.message
    assert repo.get("mlp") is old and repo.all_ready()
    assert repo.index() == [{"name": "mlp", "version": "1", "state": "READY", "reason": ""}]

    replace_file(model_dir / "1" / "model.onnx", good)
    (model_dir / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { preferred_batch_size: 16 }\n"
    )
    with pytest.raises(InferenceError) as bad_config:
        await repo.load("mlp")
    assert "dynamic_batching.preferred_batch_size: 16 exceeds max_batch_size 8" in bad_config.value.message
    assert repo.get("mlp") is old

    (model_dir / "config.pbtxt").write_text("max_batch_size: 8\n")
    await repo.load("mlp")
    assert repo.get("mlp") is not old and repo.config("mlp").max_batch_size == 8
    stop.set()
    await client
    assert errors == [] and results


async def test_unload_lets_queued_requests_finish(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    repo = make_repo(tmp_path / "models")
    await repo.start()
    served = repo.get("mlp")
    x = np.ones((4, 16), np.float32)
    pending = [asyncio.create_task(infer(served, {"INPUT0": x})) for _ in range(40)]
    await asyncio.sleep(0)  # every task has submitted its job
    await repo.unload("mlp")
    outputs = await asyncio.gather(*pending)
    assert len(outputs) == 40 and all(o["OUTPUT0"].shape == (4, 4) for o in outputs)
    assert served.stats.to_dict()["inference_stats"]["success"]["count"] == 40
    assert not repo.is_ready("mlp") and repo.served() == []
    with pytest.raises(InferenceError) as err:
        repo.get("mlp")
    assert err.value.status is Status.UNAVAILABLE
    await repo.load("mlp")  # and back
    assert repo.is_ready("mlp")


WARMED = """
backend: "onnxruntime"
max_batch_size: 2
model_warmup [ { name: "frames" batch_size: 2 count: 2
  inputs { key: "images" value: { data_type: TYPE_FP32 dims: [ 3, 8, 8 ] random_data: true } } } ]
"""


async def test_warmup_runs_before_ready(tmp_path: Path, make_repo: RepoFactory,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    write_model(tmp_path / "models", "conv", "conv", config=WARMED)
    repo = make_repo(tmp_path / "models", load_models=[])
    await repo.start()
    entered, release = threading.Event(), threading.Event()
    seen: list[tuple[int, list[tuple[str, tuple[int, ...], int]]]] = []
    real_run = warmup.run

    def gated(instances: list[Any], samples: list[warmup.WarmupSample], label: str) -> None:
        entered.set()
        assert release.wait(30)
        seen.append((len(instances), [(s.name, s.inputs["images"].shape, s.count) for s in samples]))
        real_run(instances, samples, label)

    monkeypatch.setattr(warmup, "run", gated)
    loading = asyncio.create_task(repo.load("conv"))
    assert await asyncio.to_thread(entered.wait, 30)
    assert not repo.is_ready("conv") and not repo.all_ready()
    assert repo.index() == [{"name": "conv", "version": "1", "state": "LOADING", "reason": ""}]
    release.set()
    await loading
    assert repo.is_ready("conv") and repo.all_ready()
    assert seen == [(1, [("frames", (2, 3, 8, 8), 2)])]

    # A reload warms up beside the serving version, which keeps answering meanwhile.
    entered.clear()
    release.clear()
    old = repo.get("conv")
    reloading = asyncio.create_task(repo.load("conv"))
    assert await asyncio.to_thread(entered.wait, 30)
    assert repo.get("conv") is old and repo.index()[0]["state"] == "READY"
    out = await infer(old, {"images": np.ones((1, 3, 4, 4), np.float32)})
    assert out["features"].shape == (1, 4, 4, 4)
    release.set()
    await reloading
    assert repo.get("conv") is not old


async def test_failing_warmup_keeps_the_model_down(tmp_path: Path, make_repo: RepoFactory) -> None:
    config = WARMED.replace("random_data: true", 'input_data_file: "frame.raw"')
    model_dir = write_model(tmp_path / "models", "conv", "conv", config=config)
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "frame.raw").write_bytes(b"\x00" * 100)  # not 2*3*8*8 floats
    repo = make_repo(tmp_path / "models")
    await repo.start()
    assert not repo.is_ready("conv")
    [entry] = repo.index()
    assert entry["state"] == "UNAVAILABLE"
    assert (
        "model_warmup[0].inputs['images'].input_data_file" in entry["reason"]
        and "frame.raw" in entry["reason"]
    )


async def test_load_api_config_and_files(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    repo = make_repo(tmp_path / "models")
    await repo.start()
    await repo.load("mlp", config_json=json.dumps({"max_batch_size": 2, "backend": "onnxruntime"}))
    assert repo.config("mlp").max_batch_size == 2 and repo.get("mlp").backend_name == "onnxruntime"
    await repo.load("mlp")  # without an override the folder's (auto-completed) config is back
    assert repo.config("mlp").max_batch_size == 4
    with pytest.raises(InferenceError) as bad_json:
        await repo.load("mlp", config_json='{"max_batch_size": 2, "instance_groups": []}')
    assert bad_json.value.status is Status.INVALID_ARG and "instance_groups" in bad_json.value.message
    assert repo.is_ready("mlp")

    files = {"file:1/model.onnx": build_mlp(tmp_path / "a.onnx", seed=3).read_bytes()}
    config = json.dumps({"name": "fresh", "max_batch_size": 3})
    await repo.load("fresh", config_json=config, files=files)
    fresh = repo.get("fresh")
    state = tmp_path / "state" / "overrides" / "fresh"
    assert fresh.model_dir.parent == state and fresh.config.max_batch_size == 3
    x = np.ones((3, 16), np.float32)
    out = await infer(fresh, {"INPUT0": x})
    np.testing.assert_allclose(out["OUTPUT0"], _reference(tmp_path / "a.onnx", x), rtol=1e-5, atol=1e-5)
    assert any(e["name"] == "fresh" and e["state"] == "READY" for e in repo.index())

    files2 = {"1/model.onnx": build_mlp(tmp_path / "b.onnx", seed=4).read_bytes(),
              "config.pbtxt": b'name: "fresh"\nmax_batch_size: 5\n'}  # fmt: skip
    await repo.load("fresh", files=files2)
    assert repo.config("fresh").max_batch_size == 5
    assert not fresh.model_dir.exists() and [p for p in state.iterdir()] == [repo.get("fresh").model_dir]

    with pytest.raises(InferenceError) as escape:
        await repo.load("fresh", files={"../../evil/1/model.onnx": b"x"})
    assert escape.value.status is Status.INVALID_ARG and repo.is_ready("fresh")
    assert not (tmp_path / "state" / "evil").exists()
    with pytest.raises(InferenceError):
        await repo.load("fresh", files={"1/model.onnx": b"garbage"})
    assert repo.config("fresh").max_batch_size == 5 and len(list(state.iterdir())) == 1
    with pytest.raises(InferenceError):
        await repo.load("fresh", config_json="{not json", files=files)
    assert len(list(state.iterdir())) == 1  # the rejected request's files are gone
    await repo.unload("fresh")
    assert not state.exists()  # its model's folder goes with the last load's folder


async def test_concurrent_load_and_unload_are_serialised(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "mlp")
    repo = make_repo(tmp_path / "models", load_models=[])
    await repo.start()
    await asyncio.gather(repo.load("mlp"), repo.unload("mlp"), repo.load("mlp"))
    assert repo.is_ready("mlp") and len(repo.served()) == 1
    await asyncio.gather(repo.load("mlp"), repo.load("mlp"), repo.unload("mlp"))
    assert not repo.is_ready("mlp") and repo.served() == []


async def test_close_unloads_everything(tmp_path: Path, make_repo: RepoFactory) -> None:
    write_model(tmp_path / "models", "a")
    write_model(tmp_path / "models", "b", "conv")
    repo = make_repo(tmp_path / "models")
    await repo.start()
    served = repo.served()
    assert len(served) == 2
    await repo.close()
    assert repo.served() == [] and not repo.all_ready()
    assert {e["state"] for e in repo.index()} == {"UNAVAILABLE"}
    with pytest.raises(InferenceError) as err:
        await repo.load("a")
    assert err.value.status is Status.UNAVAILABLE
    for model in served:
        with pytest.raises(InferenceError):
            model.scheduler.submit(Job(inputs={}, batch_size=1, done=lambda result: None))


async def test_new_version_folder_replaces_the_old_per_policy(tmp_path: Path, make_repo: RepoFactory) -> None:
    models = tmp_path / "models"
    write_model(models, "mlp", version=1, seed=1)
    repo = make_repo(models)
    await repo.start()
    v1 = repo.get("mlp")
    write_model(models, "mlp", version=2, seed=2)  # an OTA drops in version 2; latest{1} serves only it
    await repo.load("mlp")
    assert repo.get("mlp").version == 2 and [m.version for m in repo.ready_versions("mlp")] == [2]
    assert repo.index() == [
        {"name": "mlp", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
        {"name": "mlp", "version": "2", "state": "READY", "reason": ""},
    ]
    with pytest.raises(InferenceError) as err:
        repo.get("mlp", "1")
    assert err.value.status is Status.UNAVAILABLE
    with pytest.raises(InferenceError):
        v1.scheduler.submit(Job(inputs={}, batch_size=1, done=lambda result: None))
