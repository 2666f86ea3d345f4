"""A real ZmqFrontend over the real DataPlane and shm registry, with an in-memory model repository.

The models are plain numpy functions run on a worker thread pool (the scheduler contract: submit
raises UNAVAILABLE when the queue is full; `job.done` is called on a worker thread). This tests the
frontend, the wire format, the ring and the client with real sockets and real shared memory while
the real repository/scheduler/backends are tested elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from edgeserve.config import Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.zmq.server import ZmqFrontend
from edgeserve.protocol import datatypes
from edgeserve.protocol.datatypes import BF16_DTYPE
from edgeserve.protocol.errors import not_found, unavailable
from edgeserve.scheduling.job import Job
from edgeserve.server.dataplane import DataPlane

Fn = Callable[[dict[str, Any]], dict[str, Any]]


class FakeStats:
    def __init__(self) -> None:
        self.failures = 0

    def record_fail(self, ns: int) -> None:
        self.failures += 1

    def to_dict(self) -> dict[str, Any]:
        return {}


class FakeScheduler:
    def __init__(self, fn: Fn, *, max_queue: int = 0, delay_s: float = 0.0, workers: int = 2) -> None:
        self.fn = fn
        self.max_queue = max_queue
        self.delay_s = delay_s
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="fake-model")
        self.queued = 0
        self.lock = threading.Lock()
        self.gate: threading.Event | None = None  # when set, jobs wait for it before running

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.max_queue and self.queued >= self.max_queue:
                raise unavailable("Exceeds maximum queue size")
            self.queued += 1
        self.pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        try:
            if self.gate is not None:
                self.gate.wait(10)
            if self.delay_s:
                time.sleep(self.delay_s)
            outputs = self.fn({k: np.array(v) for k, v in job.inputs.items()})
        except BaseException as exc:
            result: Any = exc
        else:
            result = outputs
        finally:
            with self.lock:
                self.queued -= 1
        job.done(result)


def tensor_config(name: str, datatype: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": datatypes.protocol_to_config(datatype), "dims": dims}


class FakeServed:
    def __init__(self, name: str, config: model_config_pb2.ModelConfig, scheduler: FakeScheduler) -> None:
        self.name = name
        self.version = 1
        self.config = config
        self.io = None
        self.model_dir = Path("/nonexistent")
        self.platform = "numpy"
        self.backend_name = "numpy"
        self.scheduler = scheduler
        self.stats = FakeStats()


def make_model(
    name: str,
    fn: Fn,
    inputs: list[tuple[str, str, list[int]]],
    outputs: list[tuple[str, str, list[int]]],
    max_batch: int = 8,
    **sched: Any,
) -> FakeServed:
    config = model_config_pb2.ModelConfig(name=name, max_batch_size=max_batch, platform="numpy")
    for n, dt, dims in inputs:
        config.input.add(
            name=n, data_type=model_config_pb2.DataType.Value(datatypes.protocol_to_config(dt)), dims=dims
        )
    for n, dt, dims in outputs:
        config.output.add(
            name=n, data_type=model_config_pb2.DataType.Value(datatypes.protocol_to_config(dt)), dims=dims
        )
    return FakeServed(name, config, FakeScheduler(fn, **sched))


def identity_model(name: str, datatype: str, **sched: Any) -> FakeServed:
    return make_model(
        name,
        lambda x: {"OUTPUT0": x["INPUT0"]},
        [("INPUT0", datatype, [-1])],
        [("OUTPUT0", datatype, [-1])],
        **sched,
    )


class FakeRepository:
    def __init__(self, models: list[FakeServed]) -> None:
        self.models = {m.name: m for m in models}

    def get(self, name: str, version: str = "") -> FakeServed:
        model = self.models.get(name)
        if model is None or (version and version != str(model.version)):
            raise not_found(f"Request for unknown model: '{name}' is not found")
        return model

    def ready_versions(self, name: str) -> list[FakeServed]:
        return [self.get(name)]

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except Exception:
            return False
        return True

    def all_ready(self) -> bool:
        return True

    def config(self, name: str, version: str = "") -> Any:
        return self.get(name, version).config

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return [{"name": n, "version": "1", "state": "READY"} for n in self.models]

    def served(self) -> list[FakeServed]:
        return list(self.models.values())


class RunningFrontend:
    def __init__(self, frontend: ZmqFrontend, dataplane: DataPlane, loop: asyncio.AbstractEventLoop) -> None:
        self.frontend = frontend
        self.dataplane = dataplane
        self.loop = loop

    @property
    def endpoint(self) -> str:
        return self.frontend.bound[0]

    @property
    def registry(self) -> SharedMemoryRegistry:
        return self.dataplane.shm

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop thread and return its result."""
        return asyncio.run_coroutine_threadsafe(_acall(fn), self.loop).result(10)


async def _acall(fn: Callable[[], Any]) -> Any:
    return fn()


@contextmanager
def running_frontend(
    models: list[FakeServed], endpoint: str, **zmq_settings: Any
) -> Iterator[RunningFrontend]:
    settings = Settings()
    settings.zmq.endpoints = [endpoint]
    for key, value in zmq_settings.items():
        setattr(settings.zmq, key, value)
    registry = SharedMemoryRegistry()
    dataplane = DataPlane(FakeRepository(models), registry)  # type: ignore[arg-type]
    frontend = ZmqFrontend(dataplane, settings)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="zmq-test-loop", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(frontend.start(), loop).result(10)
    try:
        yield RunningFrontend(frontend, dataplane, loop)
    finally:
        dataplane.shutting_down = True
        asyncio.run_coroutine_threadsafe(frontend.stop(2.0), loop).result(10)
        registry.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        for model in models:
            model.scheduler.pool.shutdown(wait=False, cancel_futures=True)


# -- helpers shared by the zmq tests -------------------------------------------------------------------
DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]


def sample(datatype: str, shape: tuple[int, ...] = (2, 5), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if datatype == "BYTES":
        return np.array(
            [f"s{seed}-{i}".encode() * (i % 3 + 1) for i in range(int(np.prod(shape)))], dtype=object
        ).reshape(shape)
    if datatype == "BF16":
        assert BF16_DTYPE is not None
        return rng.standard_normal(shape).astype(np.float32).astype(BF16_DTYPE)
    dtype = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}.get(datatype)
    if dtype is not None:
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(np.dtype(datatype.lower()))
    return rng.integers(info.min, info.max, shape, dtype=np.dtype(datatype.lower()), endpoint=True)


def gate(server: RunningFrontend, model: str) -> threading.Event:
    event = threading.Event()
    server.dataplane.repository.get(model).scheduler.gate = event  # type: ignore[attr-defined]
    return event


def ungate(server: RunningFrontend, model: str, event: threading.Event) -> None:
    event.set()
    server.dataplane.repository.get(model).scheduler.gate = None  # type: ignore[attr-defined]


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


def region_names(server: RunningFrontend) -> set[str]:
    return {r.name for r in server.call(server.registry.status)}


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False
