"""The memory-budget policy on its own: LRU choice, pinned and busy models never evicted, the error
when nothing fits, measured costs remembered per version, config flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.residency import (
    FILE_FACTOR,
    INSTANCE_OVERHEAD,
    MIB,
    Residency,
    choose_victims,
    model_flags,
    param_true,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int = 1_000) -> None:
        self.now += ns


class FakeServed:
    """Stands for a loaded model version (the residency only keys charges by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name


_loaded: dict[int, dict[str, list[FakeServed]]] = {}  # id(residency) -> name -> versions loaded


def test_choose_victims_is_lru_and_skips_what_cannot_go() -> None:
    resident = {"a": 10, "b": 10, "c": 10, "d": 10}
    used = {"a": 4, "b": 1, "c": 3, "d": 2}  # b is the least recently used, then d, c, a
    assert choose_victims(resident, used, 0, lambda n: True) == []
    assert choose_victims(resident, used, 5, lambda n: True) == ["b"]
    assert choose_victims(resident, used, 15, lambda n: True) == ["b", "d"]
    assert choose_victims(resident, used, 15, lambda n: n != "d") == ["b", "c"]
    assert choose_victims(resident, used, 25, lambda n: n in ("a", "b")) is None


def _residency(budget_mib: int, clock: FakeClock) -> Residency:
    residency = Residency(budget_mib * MIB, "test budget", clock=clock)
    residency.room_wait_s = 0.0  # nothing in these tests frees memory by waiting
    return residency


async def _load(residency: Residency, name: str, mib: int, evictable: object = None,
                evicted: list[str] | None = None) -> FakeServed:  # fmt: skip
    """Reserve + settle one version of `name` costing `mib` MiB; evictions are recorded."""
    served = FakeServed(name)
    done = evicted if evicted is not None else []
    loaded = _loaded.setdefault(id(residency), {})

    async def evict(victim: str) -> None:  # what the repository's unload does to the residency
        done.append(victim)
        for owner in loaded.pop(victim, []):
            residency.release(owner)

    can_go = evictable if callable(evictable) else (lambda n: True)
    charge = await residency.reserve(name, 1, mib * MIB, can_go, evict)
    residency.measured(charge, mib * MIB, 0)
    residency.settle(charge, served)
    loaded.setdefault(name, []).append(served)
    return served


async def test_least_recently_used_model_is_evicted_first() -> None:
    clock = FakeClock()
    residency = _residency(25, clock)
    evicted: list[str] = []
    for name in ("a", "b"):
        await _load(residency, name, 10, evicted=evicted)
        clock.advance()
    residency.touch("a")  # a used after b: b is now the least recently used
    await _load(residency, "c", 10, evicted=evicted)
    assert evicted == ["b"]
    assert sorted(residency.resident()) == ["a", "c"]
    assert residency.evictions["b"] == 1
    assert residency.used() <= 25 * MIB


async def test_pinned_and_busy_models_are_never_evicted() -> None:
    clock = FakeClock()
    residency = _residency(30, clock)
    for name in ("pinned", "busy", "idle"):
        await _load(residency, name, 10)
        clock.advance()
    residency.pinned.add("pinned")
    evicted: list[str] = []
    await _load(residency, "new", 10, evictable=lambda n: n != "busy", evicted=evicted)
    assert evicted == ["idle"]  # the oldest two could not go
    with pytest.raises(InferenceError) as caught:
        await _load(residency, "more", 10, evictable=lambda n: n not in ("busy", "new"))
    error = caught.value
    assert error.status is Status.RESOURCE_EXHAUSTED
    for words in ("30.0 MiB", "test budget", "pinned 10.0 MiB (pinned)", "busy 10.0 MiB (busy)",
                  "memory_budget_mb"):  # fmt: skip
        assert words in error.message, error.message
    assert sorted(residency.resident()) == ["busy", "new", "pinned"]


async def test_a_model_bigger_than_the_budget_fails_without_evicting_anything() -> None:
    residency = _residency(20, FakeClock())
    await _load(residency, "a", 5)
    evicted: list[str] = []
    with pytest.raises(InferenceError) as caught:
        await _load(residency, "huge", 50, evicted=evicted)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert evicted == []
    assert residency.used() == 5 * MIB  # the failed reservation is not held


async def test_no_budget_never_evicts() -> None:
    residency = Residency(None, "none")
    for name in "abcdef":
        await _load(residency, name, 1000)
    assert len(residency.resident()) == 6


async def test_measured_cost_is_remembered_per_version_and_never_below_the_files(tmp_path: Path) -> None:
    residency = _residency(100, FakeClock())
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    (version_dir / "model.onnx").write_bytes(b"x" * MIB)
    assert residency.estimate("m", 1, version_dir, 2) == (int(MIB * FILE_FACTOR) + INSTANCE_OVERHEAD) * 2
    charge = await residency.reserve("m", 1, 10, lambda n: True, _never)
    residency.measured(charge, rss_growth=-4096, floor=int(MIB * FILE_FACTOR))  # memory reused: floor
    assert charge.nbytes == int(MIB * FILE_FACTOR)
    residency.measured(charge, rss_growth=7 * MIB, floor=int(MIB * FILE_FACTOR))
    assert residency.estimate("m", 1, version_dir, 1) == 7 * MIB
    residency.cancel(charge)
    assert residency.used() == 0


async def _never(name: str) -> None:  # pragma: no cover - nothing to evict in that test
    raise AssertionError(f"evicted {name}")


def test_flags_from_config_parameters(tmp_path: Path) -> None:
    (tmp_path / "config.pbtxt").write_text(
        'parameters { key: "load_on_first_use" value { string_value: "true" } }\n'
        'parameters { key: "pinned" value { string_value: "no" } }\n'
    )
    assert model_flags(tmp_path) == (True, False)
    assert model_flags(tmp_path / "missing") == (False, False)
    (tmp_path / "config.pbtxt").write_text("this is { not a config")
    assert model_flags(tmp_path) == (False, False)

    class Config:
        parameters: dict[str, object] = {}

    assert not param_true(Config(), "pinned")
