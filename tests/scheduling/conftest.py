"""Fixtures for the scheduler tests: real ONNX models and schedulers that are closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from onnx_models import build_add_sub, build_conv_dynamic_hw, build_mlp
from sched_helpers import GatedInstance, GatedSchedulers, OrtInstance, make_config

from edgeserve.scheduling.scheduler import Scheduler


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sched-models")
    return {
        "mlp": build_mlp(root / "mlp.onnx"),
        "add_sub": build_add_sub(root / "add_sub.onnx"),
        "conv": build_conv_dynamic_hw(root / "conv.onnx"),
    }


SchedulerFactory = Callable[..., tuple[Scheduler, list[GatedInstance]]]


@pytest.fixture
def make_scheduler(model_paths: dict[str, Path]) -> Iterator[SchedulerFactory]:
    """`make_scheduler(model, config_text, instances=1, open_gate=True, **kwargs)` -> (started
    scheduler, its gated instances); every scheduler is closed after the test."""
    schedulers = GatedSchedulers(Scheduler)

    def factory(model: str, config_text: str, instances: int = 1, open_gate: bool = True,
                **kwargs: Any) -> tuple[Scheduler, list[GatedInstance]]:  # fmt: skip
        config = make_config(f'name: "{model}"\n' + config_text)
        started: tuple[Scheduler, list[GatedInstance]] = schedulers.start(
            model, model_paths[model], config, instances, open_gate, **kwargs
        )
        return started

    yield factory
    schedulers.close()


@pytest.fixture
def reference(model_paths: dict[str, Path]) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """Run one request straight through its own onnxruntime session (the expected answer)."""
    sessions: dict[str, OrtInstance] = {}

    def run(model: str, inputs: dict[str, Any]) -> dict[str, Any]:
        if model not in sessions:
            sessions[model] = OrtInstance(model_paths[model])
        return sessions[model].infer(inputs)

    return run
