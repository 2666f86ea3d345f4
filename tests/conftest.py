"""Shared fixtures: a real edgeserve server process on loopback, with free ports."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/onnx_models.py, tests/es_server.py

from es_server import ROOT, RunningServer, ServerFactory, free_port, start_server, stopped_after

__all__ = ["ROOT", "RunningServer", "ServerFactory", "free_port", "start_server"]


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """`server_factory(repo, args=[...], env={...})` starts a server that is stopped after the test."""
    yield from stopped_after(start_server, tmp_path)
