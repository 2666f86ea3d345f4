"""Fixtures: a repository with the tiny MLP, and `edgeserve run` appliances stopped after each test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from appliance import Appliance, ApplianceFactory, start_appliance
from es_server import stopped_after
from onnx_models import write_model


@pytest.fixture
def mlp_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp")
    return repo


@pytest.fixture
def appliance_factory(tmp_path: Path) -> Iterator[ApplianceFactory]:
    yield from stopped_after(start_appliance, tmp_path)


@pytest.fixture
def app(mlp_repo: Path, appliance_factory: ApplianceFactory) -> Appliance:
    """An appliance serving the tiny MLP, past READY=1."""
    started: Appliance = appliance_factory(mlp_repo)
    started.notify.wait_for("READY", timeout=60)
    return started
