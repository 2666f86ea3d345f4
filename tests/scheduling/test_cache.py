"""Response cache unit tests: keys never shared between different inputs, LRU eviction under the byte
bound, read-only copies, entries purged with their model version, per-model statistics."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from sched_helpers import make_config

from edgeserve.scheduling.cache import (
    ENTRY_OVERHEAD_BYTES,
    ResponseCache,
    cache_enabled,
    has_sequence,
    request_key,
)
from edgeserve.scheduling.stats import ModelStats

CACHED = make_config('name: "m"\nmax_batch_size: 4\nresponse_cache { enable: true }')


@dataclass(eq=False)
class Model:
    name: str = "m"
    version: int = 1
    config: Any = field(default_factory=lambda: CACHED)
    stats: ModelStats = field(default_factory=lambda: ModelStats("m", 1))


def _inputs(value: float, n: int = 4) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full((1, n), value, dtype=np.float32)}


def _run(cache: ResponseCache, model: Model, inputs: dict[str, np.ndarray], compute: Any) -> dict[str, Any]:
    """The data plane's use: a hit answers at once, a miss runs `compute` and stores its result."""
    ticket = cache.begin(model, {}, inputs, ["OUTPUT0"])
    assert ticket is not None
    if ticket.outputs is not None:
        model.stats.record_cache_hit(1000, ticket.lookup_ns)
        return ticket.outputs
    got: dict[str, Any] = {}

    def done(result: Any) -> None:
        got.update(result)

    ticket.wrap(done)(compute(inputs))
    return got


def test_keys_differ_for_any_difference() -> None:
    base = {"a": np.arange(4, dtype=np.float32).reshape(1, 4)}
    key = request_key(1, "m", 1, base, ["y"])
    assert key == request_key(1, "m", 1, {"a": base["a"].copy()}, ["y"])
    variants = [
        request_key(2, "m", 1, base, ["y"]),  # another load of the model
        request_key(1, "n", 1, base, ["y"]),
        request_key(1, "m", 2, base, ["y"]),
        request_key(1, "m", 1, {"a": base["a"] + 1}, ["y"]),
        request_key(1, "m", 1, {"a": base["a"].reshape(1, 2, 2)}, ["y"]),  # same bytes, other shape
        request_key(1, "m", 1, {"a": base["a"].view(np.int32)}, ["y"]),  # same bytes, other dtype
        request_key(1, "m", 1, {"b": base["a"]}, ["y"]),
        request_key(1, "m", 1, base, ["y", "z"]),
        request_key(1, "m", 1, base, []),
        request_key(1, "m", 1, {"a": np.asfortranarray(np.arange(4, dtype=np.float32).reshape(2, 2))}, ["y"]),
    ]
    assert len({key, *variants}) == len(variants) + 1
    # custom request parameters are part of the key (a Python model reads them), each with its type
    kinds: list[dict[str, Any]] = [
        {"k": 1},
        {"k": 2},
        {"k": "1"},
        {"k": 1.0},
        {"k": True},
        {"j": 1},
        {"j": 1, "k": 1},
    ]
    params = [request_key(1, "m", 1, base, ["y"], p) for p in kinds]
    assert len({key, *params}) == len(params) + 1
    assert request_key(1, "m", 1, base, ["y"], {"triton_x": 1}) == key  # Triton's own: not in the key
    assert request_key(1, "m", 1, base, ["y"], {"k": 1, "j": 2}) == request_key(
        1, "m", 1, base, ["y"], {"j": 2, "k": 1}
    )
    words = {"s": np.array([[b"ab", b"c"]], dtype=np.object_)}
    other = {"s": np.array([[b"a", b"bc"]], dtype=np.object_)}  # same concatenated bytes
    assert request_key(1, "m", 1, words, ["y"]) != request_key(1, "m", 1, other, ["y"])


def test_enabled_only_by_config_and_never_for_sequences() -> None:
    assert cache_enabled(CACHED)
    assert not cache_enabled(make_config('name: "m"\nmax_batch_size: 4'))
    sequence = make_config('name: "m"\nresponse_cache { enable: true }\nsequence_batching { }')
    assert not cache_enabled(sequence)
    decoupled = 'name: "m"\nresponse_cache { enable: true }\nmodel_transaction_policy { decoupled: true }'
    assert not cache_enabled(make_config(decoupled))
    assert has_sequence({"sequence_id": 7}) and has_sequence({"sequence_id": "a"})
    assert not has_sequence({"sequence_id": 0, "sequence_start": False}) and not has_sequence({})
    cache = ResponseCache(1 << 20)
    assert cache.begin(Model(), {"sequence_id": 3}, _inputs(1.0), ["OUTPUT0"]) is None
    plain = Model(config=make_config('name: "m"\nmax_batch_size: 4'))
    assert cache.begin(plain, {}, _inputs(1.0), ["OUTPUT0"]) is None
    assert ResponseCache(0).begin(Model(), {}, _inputs(1.0), ["OUTPUT0"]) is None


def test_hits_misses_and_stats() -> None:
    cache, model = ResponseCache(1 << 20), Model()
    calls: list[float] = []

    def compute(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(float(inputs["INPUT0"][0, 0]))
        return {"OUTPUT0": inputs["INPUT0"] * 2, "EXTRA": np.zeros(3)}

    for value in (1.0, 2.0, 1.0, 1.0, 2.0, 3.0):
        out = _run(cache, model, _inputs(value), compute)
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 4), value * 2, dtype=np.float32))
    assert calls == [1.0, 2.0, 3.0]
    stats = model.stats.to_dict()["inference_stats"]
    assert stats["cache_hit"]["count"] == 3 and stats["cache_miss"]["count"] == 3
    assert stats["success"]["count"] == 3  # hits count as successes; the misses' runs are not recorded here
    counters = cache.counters()
    assert (counters.entries, counters.hits, counters.misses, counters.evictions) == (3, 3, 3, 0)
    snapshot = model.stats.snapshot()
    assert snapshot.cache_hit.count == 3 and snapshot.inference_count == 0


def test_entries_are_read_only_copies() -> None:
    cache, model = ResponseCache(1 << 20), Model()
    produced = {"OUTPUT0": np.ones((1, 4), dtype=np.float32)}
    _run(cache, model, _inputs(5.0), lambda _: produced)
    produced["OUTPUT0"][:] = 99  # the model's buffer is reused for another batch
    hit = _run(cache, model, _inputs(5.0), lambda _: pytest.fail("must be a hit"))
    np.testing.assert_array_equal(hit["OUTPUT0"], np.ones((1, 4)))
    with pytest.raises(ValueError):
        hit["OUTPUT0"][0, 0] = 7  # a client's answer cannot change the entry


def test_lru_eviction_under_the_byte_bound() -> None:
    entry = ENTRY_OVERHEAD_BYTES + 32 + len("OUTPUT0") + 1024 * 4
    cache, model = ResponseCache(3 * entry + 10), Model()

    def compute(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": np.repeat(inputs["INPUT0"], 256, axis=1)}  # 1024 float32 = 4 KiB

    for value in (1.0, 2.0, 3.0):
        _run(cache, model, _inputs(value), compute)
    _run(cache, model, _inputs(1.0), compute)  # 1 becomes the most recently used
    _run(cache, model, _inputs(4.0), compute)  # evicts 2, the least recently used
    counters = cache.counters()
    assert counters.entries == 3 and counters.evictions == 1 and counters.bytes <= cache.capacity
    misses = model.stats.to_dict()["inference_stats"]["cache_miss"]["count"]
    _run(cache, model, _inputs(1.0), compute)
    _run(cache, model, _inputs(3.0), compute)
    assert model.stats.to_dict()["inference_stats"]["cache_miss"]["count"] == misses  # both kept
    _run(cache, model, _inputs(2.0), compute)
    assert model.stats.to_dict()["inference_stats"]["cache_miss"]["count"] == misses + 1  # evicted
    big = ResponseCache(entry // 2)  # an entry larger than the whole cache is not stored
    _run(big, model, _inputs(1.0), compute)
    assert big.counters().entries == 0


def test_errors_are_not_cached() -> None:
    cache, model = ResponseCache(1 << 20), Model()
    ticket = cache.begin(model, {}, _inputs(1.0), ["OUTPUT0"])
    assert ticket is not None and ticket.outputs is None
    seen: list[Any] = []
    ticket.wrap(seen.append)(RuntimeError("backend failed"))
    assert isinstance(seen[0], RuntimeError) and cache.counters().entries == 0


def test_a_released_model_version_takes_its_entries() -> None:
    cache = ResponseCache(1 << 20)
    old, other = Model(), Model(name="other")
    _run(cache, old, _inputs(1.0), lambda x: {"OUTPUT0": x["INPUT0"]})
    _run(cache, other, _inputs(1.0), lambda x: {"OUTPUT0": x["INPUT0"]})
    reloaded = Model()  # same name and version, a new load: never served the old entries
    out = _run(cache, reloaded, _inputs(1.0), lambda x: {"OUTPUT0": x["INPUT0"] + 1})
    np.testing.assert_array_equal(out["OUTPUT0"], _inputs(2.0)["INPUT0"])
    assert cache.counters().entries == 3
    del old
    gc.collect()
    assert cache.counters().entries == 2


def test_concurrent_distinct_inputs_never_mix() -> None:
    cache, model = ResponseCache(256 * 1024), Model()
    errors: list[str] = []

    def compute(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": inputs["INPUT0"] * 3 + 1}

    def client(worker: int) -> None:
        rng = np.random.default_rng(worker)
        for _ in range(300):
            value = float(rng.integers(0, 40)) + worker * 1000.0
            out = _run(cache, model, _inputs(value), compute)
            if not np.array_equal(out["OUTPUT0"], _inputs(value * 3 + 1)["INPUT0"]):
                errors.append(f"worker {worker}: {value} -> {out['OUTPUT0']}")

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = model.stats.to_dict()["inference_stats"]
    assert stats["cache_hit"]["count"] + stats["cache_miss"]["count"] == 8 * 300
    assert stats["cache_hit"]["count"] >= 8 * (300 - 40)


def test_a_closed_scheduler_is_freed_with_its_entries(model_paths: dict[str, Any]) -> None:
    """The hang watchdog must not keep a retired scheduler (and its stats, the cache's key owner)."""
    import time
    import weakref

    from sched_helpers import load_instance

    from edgeserve.scheduling.scheduler import Scheduler

    config = make_config('name: "mlp"\nmax_batch_size: 8\nresponse_cache { enable: true }')
    cache = ResponseCache(1 << 20)
    model = Model(name="mlp", config=config, stats=ModelStats("mlp", 1))
    scheduler = Scheduler("mlp", 1, config, [load_instance(model_paths["mlp"], config)], model.stats)
    scheduler.start()
    _run(cache, model, _inputs(1.0, 16), lambda x: {"OUTPUT0": x["INPUT0"][:, :4]})
    assert cache.counters().entries == 1
    time.sleep(0.2)  # the watchdog has looked at it a few times
    scheduler.close()
    alive = weakref.ref(scheduler)
    del scheduler, model
    deadline = time.monotonic() + 60  # generous: waits on the collection, not on this box's speed
    while (alive() is not None or cache.counters().entries) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() is None and cache.counters().entries == 0
