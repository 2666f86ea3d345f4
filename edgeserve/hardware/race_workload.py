"""What a load-time race times (race.py races it): the auto-completed config, the scenarios and feeds
from the config (1 in flight; the dynamic batcher's preferred sizes, else max_batch_size, a batch per
instance; 1 per instance when only layouts differ) on the model's own inputs (inputs.py) or random data
on the config's shapes, and the cache key of a result (race_result.RaceCache)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.hardware.plan import ModelPlan, Planner
from edgeserve.hardware.race_timing import Entrant, Scenario

RACED_BACKENDS = ("onnxruntime", "openvino")
RACE_VERSION = 3  # bump when what is timed changes, so old cache entries are not reused


def complete(planner: Planner, plan: ModelPlan, name: str, config: Any, where: str) -> Any:
    """The config as auto-complete fills it for the plan's choice (what the race feeds and loads)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from edgeserve.backends.base import get_backend
    from edgeserve.repository import autocomplete

    assert plan.chosen is not None and plan.chosen.artifact is not None
    backend = get_backend(plan.chosen.option.backend)
    return autocomplete.complete(
        config if config is not None else mc.ModelConfig(), backend.inspect(plan.chosen.artifact),
        model_name=name, backend_name=backend.name, platform="", model_file=plan.chosen.artifact.name,
        default_max_batch_size=planner.settings.runtime.default_max_batch_size, where=where,
    )  # fmt: skip


def workload(
    name: str, version_dir: Path, config: Any, completed: Any, where: str, multi: bool
) -> tuple[list[Scenario], dict[int, dict[str, Any]], str]:
    """Scenarios, a feed per batch size, and where the data came from."""
    from edgeserve.hardware.accuracy import sample_feeds
    from edgeserve.hardware.inputs import model_inputs
    from edgeserve.protocol import datatypes
    from edgeserve.repository.config import type_name

    batching = completed.max_batch_size > 0
    inputs = model_inputs(name, version_dir.parent, config, where)
    if inputs is not None:
        base = inputs.feeds[0]
        if batching:
            base = {k: v[:1] for k, v in base.items()}
        source = inputs.source
    else:
        specs = []
        for t in completed.input:
            dtype = datatypes.numpy_dtype(datatypes.config_to_protocol(type_name(t.data_type)))
            if dtype == np.object_:
                raise ValueError(f"input '{t.name}' is BYTES")
            specs.append((t.name, dtype, ([-1] if batching else []) + [int(d) for d in t.dims]))
        base = sample_feeds(specs, 1, 0)[0]
        source = "random data on the config's shapes"
    sizes: list[int] = []
    if batching:
        preferred = [int(b) for b in completed.dynamic_batching.preferred_batch_size]
        wanted = preferred or [int(completed.max_batch_size)]
        sizes = sorted({b for b in wanted if 1 < b <= completed.max_batch_size})
    scenarios = [Scenario("1 in flight", 1, False)]
    scenarios += [Scenario(f"batch {b} x instances", b, True) for b in sizes]
    if not sizes and multi:
        scenarios.append(Scenario("1 per instance", 1, True))
    feeds = {1: base}
    for b in sizes:
        feeds[b] = {k: np.concatenate([v] * b) for k, v in base.items()}
    return scenarios, feeds, source


def key(
    planner: Planner, budget_s: float, entrants: list[Entrant], scenarios: list[Scenario],
    feeds: dict[int, Any], sizes: list[int],
) -> str:  # fmt: skip
    """The race cache key: what makes a result valid for this box, model inputs and settings."""
    from edgeserve.hardware.accuracy import _cpu_model, _runtime_version

    data = {
        "version": RACE_VERSION,
        "cpu": _cpu_model(),
        "cpus": planner.hw.budget.effective_cpus,
        "threads": planner.threads()[0],
        "profile": planner.profile.name,
        "runtimes": [_runtime_version(b) for b in RACED_BACKENDS],
        "budget_s": budget_s,
        "entrants": [e.row.label() for e in entrants],
        "scenarios": [(s.name, s.batch, s.saturate) for s in scenarios],
        "shapes": {b: {k: [str(v.dtype), list(v.shape)] for k, v in f.items()} for b, f in feeds.items()},
    }
    if sizes:  # only then: the keys of models whose batch size is the config's stay as they were
        data["batch_sizes"] = sizes
        data["default_max_batch_size"] = planner.settings.runtime.default_max_batch_size
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:24]
