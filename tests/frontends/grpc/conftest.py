"""Fixtures of the gRPC frontend tests: the real servicer over a fake data plane, in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_fakes import Client, Inproc, client_for, serve_inproc


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[Inproc]:
    yield from serve_inproc(tmp_path)


@pytest.fixture
def client(inproc: Inproc) -> Iterator[Client]:
    yield from client_for(inproc[0])
