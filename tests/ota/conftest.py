"""Fixtures for the OTA tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/ota/bundle_server.py
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/es_server.py, tests/onnx_models.py

from bundle_server import BundleServer
from hostile_check import Env, make_env


@pytest.fixture
def bundle_server() -> Iterator[BundleServer]:
    """A fault-injecting HTTP file server on loopback (see bundle_server.py), stopped after the test."""
    server = BundleServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(tmp_path: Path) -> Env:
    """The device side of the hostile-bundle tests (hostile_check.py)."""
    return make_env(tmp_path)
