"""Fixtures of the ZeroMQ frontend tests: a real frontend over the real data plane (zmq_harness)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from zmq_harness import DATATYPES, RunningFrontend, identity_model, make_model, running_frontend

from edgeserve.client import ZmqClient


@pytest.fixture(scope="module")
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="esz-", dir="/tmp"))  # short: unix socket paths are <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(sockdir: Path) -> Iterator[RunningFrontend]:
    models = [identity_model(f"id_{dt.lower()}", dt) for dt in DATATYPES]
    models.append(identity_model("gated", "FP32"))
    models.append(identity_model("tiny_queue", "FP32", max_queue=1, workers=1))
    models.append(
        make_model(
            "mean",
            lambda x: {
                "MEAN": x["IMAGE"].reshape(x["IMAGE"].shape[0], -1).mean(1, keepdims=True).astype(np.float32)
            },
            [("IMAGE", "UINT8", [-1, -1, 3])],
            [("MEAN", "FP32", [1])],
        )
    )
    with running_frontend(models, f"ipc://{sockdir}/fe.zmq", max_inflight_per_client=64) as running:
        yield running


@pytest.fixture
def client(server: RunningFrontend) -> Iterator[ZmqClient]:
    with ZmqClient(server.endpoint, timeout=5.0) as c:
        yield c
