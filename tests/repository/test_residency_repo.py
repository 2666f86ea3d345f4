"""The memory budget in a real `ModelRepository` with real ONNX models (about 18 MiB each once
loaded, the budget fits two): LRU eviction through the drained unload path, reload on demand, load on
first use, pinned and busy models kept, RESOURCE_EXHAUSTED when nothing can go, the index reasons."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from repo_helpers import infer, make_settings
from residency_helpers import BUDGET_MB, make_models, param, reference

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.manager import ModelRepository
from edgeserve.repository.residency import EVICTED_REASON, FIRST_USE_REASON, MIB


async def check_answer(repository: ModelRepository, repo: Path, name: str) -> None:
    x = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    repository.touch(name)  # what the data plane does for each request
    out = await infer(repository.get(name), {"INPUT0": x})
    np.testing.assert_allclose(out["OUTPUT0"], reference(repo, name, x), rtol=1e-4, atol=1e-5)


def state(repository: ModelRepository, name: str) -> tuple[str, str]:
    entries = [e for e in repository.index() if e["name"] == name]
    assert len(entries) == 1, entries
    return entries[0]["state"], entries[0]["reason"]


@pytest.fixture
async def budget_repo(tmp_path: Path) -> Any:
    made: list[ModelRepository] = []

    async def factory(repo: Path, load_models: list[str] | None = None) -> ModelRepository:
        settings = make_settings(repo, tmp_path / "state", load_models=load_models or [])
        settings.repository.memory_budget_mb = BUDGET_MB
        repository = ModelRepository(settings)
        repository.budget.residency.room_wait_s = 1.0
        made.append(repository)
        await repository.start()
        return repository

    yield factory
    for repository in made:
        await repository.close()


async def test_past_the_budget_the_least_recently_used_model_unloads_and_reloads_on_demand(
    tmp_path: Path, budget_repo: Any
) -> None:
    repo = make_models(tmp_path, "abc")
    repository = await budget_repo(repo)
    residency = repository.budget.residency
    await repository.load("a")
    await repository.load("b")
    await check_answer(repository, repo, "a")  # a used after b: b is the least recently used
    await repository.load("c")
    assert sorted(residency.resident()) == ["a", "c"]
    assert residency.used() <= BUDGET_MB * MIB
    assert state(repository, "b") == ("UNAVAILABLE", EVICTED_REASON)
    assert residency.evictions["b"] == 1
    assert repository.all_ready()  # an evicted model does not make the server unready

    # A request for b loads it again (evicting a, now the least recently used) and then runs.
    loading = repository.load_on_demand("b", "", 30.0)
    assert loading is not None
    await asyncio.wrap_future(loading)
    await check_answer(repository, repo, "b")
    assert sorted(residency.resident()) == ["b", "c"]
    assert state(repository, "a") == ("UNAVAILABLE", EVICTED_REASON)
    assert state(repository, "b") == ("READY", "")

    # An explicit unload is the operator's: no reload on demand.
    await repository.unload("c")
    assert repository.load_on_demand("c", "", 1.0) is None
    assert state(repository, "c") == ("UNAVAILABLE", "unloaded")


async def test_load_on_first_use_waits_for_the_first_request(tmp_path: Path, budget_repo: Any) -> None:
    repo = make_models(tmp_path, "ab", {"b": param("load_on_first_use")})
    repository = await budget_repo(repo, ["*"])
    assert repository.is_ready("a") and not repository.is_ready("b")
    assert state(repository, "b") == ("UNAVAILABLE", FIRST_USE_REASON)
    assert repository.all_ready()
    first = repository.load_on_demand("b", "", 30.0)
    second = repository.load_on_demand("b", "", 30.0)  # queues behind the same load
    assert first is not None and second is not None
    await asyncio.gather(asyncio.wrap_future(first), asyncio.wrap_future(second))
    await check_answer(repository, repo, "b")
    assert repository.load_on_demand("a", "", 1.0) is None  # a plain model: never loaded on demand
    await repository.unload("b")  # the operator's unload holds even for a load-on-first-use model
    assert repository.load_on_demand("b", "", 1.0) is None
    await repository.load("b")
    await repository.unload("b", unload_dependents=False)
    assert state(repository, "b") == ("UNAVAILABLE", "unloaded")


async def test_pinned_and_busy_models_stay_and_nothing_fits_is_resource_exhausted(
    tmp_path: Path, budget_repo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_models(tmp_path, "abcd", {"a": param("pinned")})
    repository = await budget_repo(repo)
    residency = repository.budget.residency
    await repository.load("a")
    await repository.load("b")
    busy = repository.get("b").scheduler
    monkeypatch.setattr(busy, "wait_idle", lambda timeout_s=None: False)  # a request in flight
    with pytest.raises(InferenceError) as caught:
        await repository.load("c")
    error = caught.value
    assert error.status is Status.RESOURCE_EXHAUSTED
    for words in (f"{BUDGET_MB:.1f} MiB", "(pinned)", "(busy)", "memory_budget_mb"):
        assert words in error.message, error.message
    assert sorted(residency.resident()) == ["a", "b"]
    assert residency.evictions == {}
    monkeypatch.undo()  # b idle again: it is the one to go, never the pinned a
    await repository.load("c")
    assert sorted(residency.resident()) == ["a", "c"]
    await check_answer(repository, repo, "c")


async def test_on_demand_load_failure_answers_unavailable(tmp_path: Path, budget_repo: Any) -> None:
    repo = make_models(tmp_path, "a", {"a": param("load_on_first_use")})
    (repo / "a" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    repository = await budget_repo(repo, ["*"])
    loading = repository.load_on_demand("a", "", 30.0)
    assert loading is not None
    with pytest.raises(InferenceError) as caught:
        await asyncio.wrap_future(loading)
    assert caught.value.status is Status.UNAVAILABLE
    assert "could not be loaded" in caught.value.message


async def test_readiness_and_metadata_checks_do_not_count_as_use(tmp_path: Path, budget_repo: Any) -> None:
    repo = make_models(tmp_path, "abc")
    repository = await budget_repo(repo)
    await repository.load("a")
    await repository.load("b")
    for _ in range(3):  # a health checker polling: not a use of a
        assert repository.all_ready() and repository.is_ready("a")
        repository.config("a")
    await repository.load("c")
    assert sorted(repository.budget.residency.resident()) == ["b", "c"]  # a was the least recently used
