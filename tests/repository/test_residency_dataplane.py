"""Load on first use through the data plane every frontend calls: requests arriving while the load
runs queue behind the one load and are all answered, a request whose timeout passes first gets
UNAVAILABLE (the load goes on), a load that fails answers UNAVAILABLE with the reason."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from repo_helpers import make_settings
from residency_helpers import make_models, param, reference

from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.inference import InferRequest, InputTensor
from edgeserve.repository import manager
from edgeserve.repository.manager import ModelRepository
from edgeserve.server.dataplane import DataPlane


def request(name: str, x: np.ndarray, timeout_us: int = 0) -> InferRequest:
    return InferRequest(
        name, inputs=[InputTensor("INPUT0", "FP32", tuple(x.shape), x)], timeout_us=timeout_us
    )


@pytest.fixture
async def plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(data plane over a repository whose model 'a' loads on first use, gate that holds its load)."""
    repo = make_models(tmp_path, "a", {"a": param("load_on_first_use")})
    gate = threading.Event()
    real = manager.prepare_version

    def held(*args: Any) -> Any:
        assert gate.wait(30), "the test never opened the load gate"
        return real(*args)

    monkeypatch.setattr(manager, "prepare_version", held)
    repository = ModelRepository(make_settings(repo, tmp_path / "state", load_models=["*"]))
    await repository.start()
    yield DataPlane(repository, SharedMemoryRegistry(False, (), 4)), gate, repo
    gate.set()
    await repository.close()


async def test_requests_wait_for_one_load_and_a_short_timeout_answers_unavailable(plane: Any) -> None:
    dataplane, gate, repo = plane
    repository = dataplane.repository
    assert not repository.is_ready("a")
    xs = [np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32) for i in range(4)]
    waiting = [asyncio.ensure_future(dataplane.infer(request("a", x))) for x in xs]
    short = asyncio.ensure_future(dataplane.infer(request("a", xs[0], timeout_us=200_000)))
    with pytest.raises(InferenceError) as caught:
        await short  # the load is held: 0.2 s passes first
    assert caught.value.status is Status.UNAVAILABLE
    assert "did not serve within 0.2 s" in caught.value.message
    assert not any(task.done() for task in waiting)
    assert dataplane.inflight == len(waiting)  # the answered one left the in-flight count
    gate.set()
    answers = await asyncio.wait_for(asyncio.gather(*waiting), 60)
    for answer, x in zip(answers, xs, strict=True):
        np.testing.assert_allclose(answer.outputs[0].data, reference(repo, "a", x), rtol=1e-4, atol=1e-5)
    assert repository.ready_versions("a")[0].stats.to_dict()["inference_stats"]["success"]["count"] == 4
    assert dataplane.inflight == 0
    assert repository.budget.residency.first_use == {"a"}


async def test_a_failed_load_on_first_use_answers_unavailable(plane: Any) -> None:
    dataplane, gate, repo = plane
    (repo / "a" / "1" / "model.onnx").write_bytes(b"broken")
    gate.set()
    with pytest.raises(InferenceError) as caught:
        await dataplane.infer(request("a", np.zeros((1, 16), np.float32)))
    assert caught.value.status is Status.UNAVAILABLE
    assert "could not be loaded for this request" in caught.value.message
    assert dataplane.repository.all_ready()  # a failed load on demand does not make the server unready
    assert dataplane.inflight == 0
    with pytest.raises(InferenceError) as unknown:
        await dataplane.infer(request("nope", np.zeros((1, 16), np.float32)))
    assert unknown.value.status is Status.NOT_FOUND  # not a load-on-first-use model: answered at once
