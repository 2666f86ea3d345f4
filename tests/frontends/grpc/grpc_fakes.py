"""The real DataPlane and GrpcFrontend over an in-memory repository whose models are numpy functions
run on worker threads: tests of the gRPC layer that do not depend on the repository or backends.

`InProcessServer` runs the frontend on an event loop in a background thread so the synchronous
`tritonclient.grpc` client can drive it from the test thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig

from edgeserve.backends.base import ModelIO
from edgeserve.config import Settings
from edgeserve.frontends.grpc.server import GrpcFrontend
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import internal, not_found
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.stats import ModelStats
from edgeserve.server.dataplane import DataPlane

Fn = Callable[[dict[str, Any]], dict[str, Any]]


class FakeScheduler:
    def __init__(self, fn: Fn, stats: ModelStats, pool: ThreadPoolExecutor) -> None:
        self.fn = fn
        self.stats = stats
        self.pool = pool
        self.jobs: list[Job] = []  # what reached the scheduler (priority, timeout checks)

    def submit(self, job: Job) -> None:
        self.jobs.append(job)
        self.pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        start = time.monotonic_ns()
        try:
            outputs = self.fn(job.inputs)
        except Exception as exc:
            self.stats.record_fail(time.monotonic_ns() - start, "BACKEND")
            job.done(internal(f"backend failed: {exc}"))
            return
        took = time.monotonic_ns() - start
        self.stats.record_batch(job.batch_size, 0, took, 0)
        self.stats.record_success(time.monotonic_ns() - job.arrival_ns, 0, 0, took, 0)
        job.done(outputs)


@dataclass
class FakeServed:
    name: str
    version: int
    config: ModelConfig
    scheduler: FakeScheduler
    stats: ModelStats
    model_dir: Path
    io: ModelIO = field(default_factory=lambda: ModelIO((), ()))
    platform: str = "onnxruntime_onnx"
    backend_name: str = "onnxruntime"


class FakeRepository:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.models: dict[str, FakeServed] = {}
        self.loads: list[tuple[str, str | None, dict[str, bytes] | None]] = []
        self.unloads: list[tuple[str, bool]] = []
        self.pool = ThreadPoolExecutor(16, thread_name_prefix="fake-model")

    def add(self, name: str, config_text: str, fn: Fn, version: int = 1) -> None:
        config = text_format.Parse(config_text, ModelConfig())
        config.name = name
        config.platform = "onnxruntime_onnx"
        stats = ModelStats(name, version)
        self.models[name] = FakeServed(
            name, version, config, FakeScheduler(fn, stats, self.pool), stats, self.model_dir
        )

    def get(self, name: str, version: str = "") -> FakeServed:
        served = self.models.get(name)
        if served is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version and version != str(served.version):
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return served

    def ready_versions(self, name: str) -> list[FakeServed]:
        return [self.models[name]] if name in self.models else []

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except Exception:
            return False
        return True

    def all_ready(self) -> bool:
        return True

    def config(self, name: str, version: str = "") -> ModelConfig:
        return self.get(name, version).config

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return [
            {"name": n, "version": str(s.version), "state": "READY", "reason": ""}
            for n, s in self.models.items()
        ]

    def served(self) -> list[FakeServed]:
        return list(self.models.values())

    async def load(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        self.loads.append((name, config_json, files))
        if config_json is not None:
            json_format.Parse(config_json, ModelConfig())

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))
        if name not in self.models:
            raise not_found(f"failed to unload '{name}', no version is available")


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
    plane = DataPlane(repo, SharedMemoryRegistry())  # type: ignore[arg-type]
    return plane, repo


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
