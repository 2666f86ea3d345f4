"""The autoscaler wired into a real repository: a real ONNX model that opts in gets a real extra
instance (its own loaded and warmed-up session) while its queue looks deep, the memory it holds grows
and shrinks with it, and the repository's close stops the autoscaler. The queue depth is faked and
the clock is driven by hand, so nothing depends on timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from onnx_models import write_model

from edgeserve.config import Settings
from edgeserve.repository.manager import ModelRepository
from edgeserve.scheduling import instance_pool
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.scheduler import Scheduler

CONFIG = (
    'backend: "onnxruntime"\nmax_batch_size: 4\n'
    'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
    'parameters { key: "autoscale" value { string_value: "true" } }\n'
    'parameters { key: "autoscale_max_instances" value { string_value: "2" } }\n'
    'parameters { key: "autoscale_idle_s" value { string_value: "5" } }\n'
)


async def run(served: object, x: np.ndarray) -> np.ndarray:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[object] = loop.create_future()
    scheduler = served.scheduler  # type: ignore[attr-defined]
    scheduler.submit(Job(inputs={"INPUT0": x}, batch_size=x.shape[0],
                         done=lambda r: loop.call_soon_threadsafe(future.set_result, r)))  # fmt: skip
    result = await future
    assert isinstance(result, dict), result
    return np.asarray(result["OUTPUT0"])


async def test_a_real_model_grows_and_shrinks_with_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "models"
    write_model(repo, "m", "mlp", config=CONFIG)
    settings = Settings()
    settings.server.model_repository = repo
    settings.server.state_dir = tmp_path / "state"
    settings.runtime.cpu_threads = 1
    repository = ModelRepository(settings)
    await repository.start()
    try:
        scaler = repository.budget.autoscaler
        assert scaler is not None
        await scaler.stop()  # driven by hand from here
        now = [0.0]
        scaler._clock = lambda: now[0]
        scaler.cpus = 2
        served = repository.get("m")
        scheduler = served.scheduler
        assert isinstance(scheduler, Scheduler)
        residency = repository.budget.residency
        before = residency.resident()["m"]
        x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
        expected = await run(served, x)

        monkeypatch.setattr(Scheduler, "pending_count", property(lambda self: 5))
        monkeypatch.setattr(scheduler, "wait_idle", lambda timeout_s=None: False)
        await scaler.step()
        now[0] += 1.5
        await scaler.step()
        assert instance_pool.active_count(scheduler) == 2
        assert residency.resident()["m"] == 2 * before
        now[0] += 10.0
        await scaler.step()
        assert instance_pool.active_count(scheduler) == 2  # autoscale_max_instances
        monkeypatch.undo()

        for _ in range(4):  # both instances answer the same
            np.testing.assert_allclose(await run(served, x), expected, rtol=1e-6)
        assert scheduler.wait_idle(10)
        await scaler.step()
        now[0] += 6.0
        await scaler.step()
        assert instance_pool.active_count(scheduler) == 1
        assert residency.resident()["m"] == before
        np.testing.assert_allclose(await run(served, x), expected, rtol=1e-6)
    finally:
        await repository.close()
    assert scaler._task is None
