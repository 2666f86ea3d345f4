"""The real DataPlane and GrpcFrontend over the in-memory repository of `fake_plane`: tests of the gRPC
layer that do not depend on the repository or backends.

`InProcessServer` runs the frontend on an event loop in a background thread so the synchronous
`tritonclient.grpc` client can drive it from the test thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from fake_plane import FakeRepository, fake_plane

from edgeserve.config import Settings
from edgeserve.frontends.grpc.server import GrpcFrontend
from edgeserve.server.dataplane import DataPlane

ADD_SUB = """
max_batch_size: 8
input { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }
input { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
output { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }
output { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
"""
# SLEEP: waits DELAY_MS milliseconds, then echoes it (out-of-order completion on one stream).
SLEEP = """
max_batch_size: 8
input { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] }
output { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }
"""
ECHO_BYTES = """
input { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }
output { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] }
"""


def add_sub(inputs: dict[str, Any]) -> dict[str, Any]:
    a, b = inputs["INPUT0"], inputs["INPUT1"]
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


def sleep_model(inputs: dict[str, Any]) -> dict[str, Any]:
    delay = inputs["DELAY_MS"]
    if int(delay.max()) < 0:
        raise ValueError("negative delay")
    time.sleep(int(delay.max()) / 1000)
    return {"OUT": np.array(delay, dtype=np.int32)}


def make_plane(tmp: Path) -> tuple[DataPlane, FakeRepository]:
    repo = FakeRepository(tmp)
    repo.add("simple", ADD_SUB, add_sub)
    repo.add("sleep", SLEEP, sleep_model)
    repo.add("echo", ECHO_BYTES, lambda x: {"ECHO": x["TEXT"]})
    return fake_plane(repo), repo


class InProcessServer:
    """GrpcFrontend on 127.0.0.1:<free port> in a background event loop."""

    def __init__(self, plane: DataPlane, settings: Settings | None = None) -> None:
        self.plane = plane
        self.settings = settings or Settings()
        self.settings.grpc.host = self.settings.grpc.host or "127.0.0.1"
        self.settings.grpc.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="grpc-test-loop")
        self.thread.start()
        self.frontend = GrpcFrontend(plane, self.settings)
        self.call(self.frontend.start())

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.frontend.port}"

    def pending_tasks(self) -> int:
        async def count() -> int:
            return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

        return int(self.call(count()))

    def close(self) -> None:
        try:
            self.call(self.frontend.stop(1.0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def serve_inproc(
    tmp: Path, settings: Settings | None = None
) -> Iterator[tuple[InProcessServer, FakeRepository]]:
    """Body of the test modules' `inproc` fixtures (no conftest.py here: a second module named
    `conftest` would shadow tests/conftest.py for `from conftest import ...` in later directories)."""
    plane, repo = make_plane(tmp)
    server = InProcessServer(plane, settings)
    try:
        yield server, repo
    finally:
        server.close()
        repo.pool.shutdown(wait=False, cancel_futures=True)


def client_for(server: InProcessServer) -> Iterator[Any]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.url)
    try:
        yield client
    finally:
        client.close()


Client: TypeAlias = Any  # tritonclient.grpc.InferenceServerClient (untyped)
Inproc: TypeAlias = tuple[InProcessServer, FakeRepository]


def add_sub_inputs(a: np.ndarray, b: np.ndarray, client: Any = None) -> list[Any]:
    """INPUT0 = a and INPUT1 = b (INT32) for the add_sub model; `client`: tritonclient.grpc (default) or
    tritonclient.http."""
    import tritonclient.grpc as grpcclient

    module = client or grpcclient
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs
