"""Shared fixtures: a real edgeserve server process on loopback, with free ports."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/onnx_models.py, tests/es_server.py

from es_server import ROOT, RunningServer, ServerFactory, free_port, start_server

__all__ = ["ROOT", "RunningServer", "ServerFactory", "free_port", "start_server"]


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """`server_factory(repo, args=[...], env={...})` starts a server that is stopped after the test."""
    started: list[RunningServer] = []

    def factory(repository: Path, **kwargs: object) -> RunningServer:
        server = start_server(repository, tmp_path, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
