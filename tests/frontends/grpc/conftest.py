"""Fixtures of the gRPC frontend tests: an in-process frontend over fake models, and its client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from grpc_fakes import FakeRepository, InProcessServer, make_plane


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[tuple[InProcessServer, FakeRepository]]:
    plane, repo = make_plane(tmp_path)
    server = InProcessServer(plane)
    try:
        yield server, repo
    finally:
        server.close()
        repo.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def client(inproc: tuple[InProcessServer, FakeRepository]) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(inproc[0].url)
    try:
        yield c
    finally:
        c.close()
