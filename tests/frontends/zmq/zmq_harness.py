"""A real ZmqFrontend over the real DataPlane and shm registry, with the in-memory model repository of
`fake_plane`.

The models are plain numpy functions run on a worker thread pool (the scheduler contract: submit
raises UNAVAILABLE when the queue is full; `job.done` is called on a worker thread). This tests the
frontend, the wire format, the ring and the client with real sockets and real shared memory while
the real repository/scheduler/backends are tested elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fake_plane import FakeRepository, FakeScheduler, FakeServed, Fn, fake_plane
from tritonclient.grpc import model_config_pb2

from edgeserve.config import Settings
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.frontends.zmq.server import ZmqFrontend
from edgeserve.protocol import datatypes
from edgeserve.protocol.datatypes import BF16_DTYPE
from edgeserve.protocol.datatypes import DATATYPES as DATATYPES_ALL
from edgeserve.scheduling.stats import ModelStats
from edgeserve.server.dataplane import DataPlane


def tensor_config(name: str, datatype: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": datatypes.protocol_to_config(datatype), "dims": dims}


NO_DIR = Path("/nonexistent")


def make_model(
    name: str,
    fn: Fn,
    inputs: list[tuple[str, str, list[int]]],
    outputs: list[tuple[str, str, list[int]]],
    max_batch: int = 8,
    *,
    max_queue: int = 0,
    delay_s: float = 0.0,
    workers: int = 2,
) -> FakeServed:
    """A model with its own pool of `workers` threads; its inputs are copied before `fn` sees them."""
    config = model_config_pb2.ModelConfig(name=name, max_batch_size=max_batch, platform="numpy")
    for n, dt, dims in inputs:
        config.input.add(
            name=n, data_type=model_config_pb2.DataType.Value(datatypes.protocol_to_config(dt)), dims=dims
        )
    for n, dt, dims in outputs:
        config.output.add(
            name=n, data_type=model_config_pb2.DataType.Value(datatypes.protocol_to_config(dt)), dims=dims
        )
    stats = ModelStats(name, 1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="fake-model")
    scheduler = FakeScheduler(fn, stats, pool, max_queue=max_queue, delay_s=delay_s, copy_inputs=True)
    return FakeServed(name, 1, config, scheduler, stats, NO_DIR, platform="numpy", backend_name="numpy")


def identity_model(name: str, datatype: str, **sched: Any) -> FakeServed:
    return make_model(
        name,
        lambda x: {"OUTPUT0": x["INPUT0"]},
        [("INPUT0", datatype, [-1])],
        [("OUTPUT0", datatype, [-1])],
        **sched,
    )


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
    repo = FakeRepository(NO_DIR, models)
    dataplane = fake_plane(repo, registry)
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
        repo.close()


# -- helpers shared by the zmq tests -------------------------------------------------------------------
DATATYPES = list(DATATYPES_ALL)


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
    return set(server.call(server.registry.names))  # every client's: a client's status lists its own
