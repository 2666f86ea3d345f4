"""An in-memory model repository for a real `DataPlane`: the "models" are numpy functions run on
worker threads, so each frontend layer (gRPC, HTTP, ZeroMQ) can be tested without the real repository,
scheduler or backends, which are tested elsewhere.

The scheduler keeps the real one's contract: `submit` raises UNAVAILABLE when the queue is full, and
`job.done` is called on a worker thread with the outputs or an INTERNAL error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig

from edgeserve.backends.base import ModelIO
from edgeserve.frontends.shm.registry import SharedMemoryRegistry
from edgeserve.protocol.errors import internal, not_found, unavailable
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.stats import ModelStats
from edgeserve.server.dataplane import DataPlane

Fn = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(eq=False)
class FakeScheduler:
    """Runs `fn` on `pool`. `mode`: "" runs it, "full" refuses every job (UNAVAILABLE), "crash" fails
    every job in the backend. `max_queue` > 0 refuses jobs while that many are queued or running;
    `delay_s` sleeps before each job; a `gate` event set on the scheduler holds jobs until it is set."""

    fn: Fn
    stats: ModelStats
    pool: ThreadPoolExecutor
    _: KW_ONLY
    mode: str = ""
    max_queue: int = 0
    delay_s: float = 0.0
    copy_inputs: bool = False
    jobs: list[Job] = field(default_factory=list, init=False)  # what reached the scheduler
    queued: int = field(default=0, init=False)
    lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    gate: threading.Event | None = field(default=None, init=False)  # when set, jobs wait for it

    inline: bool = False  # run jobs offered inline on the caller's thread (a quick idle model)

    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool:
        if not self.inline or self.mode or self.gate is not None:
            return False  # the frontend-layer tests exercise the queued path
        with self.lock:
            self.queued += 1
        self.jobs.append(job)
        self._run(job)
        return True

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.mode == "full" or (self.max_queue and self.queued >= self.max_queue):
                raise unavailable("Exceeds maximum queue size")
            self.queued += 1
        self.jobs.append(job)
        self.pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        start = time.monotonic_ns()
        try:
            if self.gate is not None:
                self.gate.wait(120)  # generous: the test opens it; a stuck one still ends
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.mode == "crash":
                raise RuntimeError("backend exploded")
            inputs = {k: np.array(v) for k, v in job.inputs.items()} if self.copy_inputs else job.inputs
            outputs = self.fn(inputs)
        except Exception as exc:
            self.stats.record_fail(time.monotonic_ns() - start, "BACKEND")
            result: Any = internal(f"backend failed: {exc}")
        else:
            took = time.monotonic_ns() - start
            self.stats.record_batch(job.batch_size, 0, took, 0)
            self.stats.record_success(time.monotonic_ns() - job.arrival_ns, 0, 0, took, 0)
            result = outputs
        finally:
            with self.lock:
                self.queued -= 1
        job.done(result)


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
    """What `DataPlane` needs of a repository; `loads`/`unloads` record the control calls."""

    def __init__(self, model_dir: Path, models: Iterable[FakeServed] = ()) -> None:
        self.model_dir = model_dir
        self.models: dict[str, FakeServed] = {m.name: m for m in models}
        self.loads: list[tuple[str, str | None, dict[str, bytes] | None]] = []
        self.unloads: list[tuple[str, bool]] = []
        self.pool = ThreadPoolExecutor(16, thread_name_prefix="fake-model")

    def add(self, name: str, config_text: str, fn: Fn, mode: str = "", version: int = 1) -> None:
        config = text_format.Parse(config_text, ModelConfig())
        config.name = name
        config.platform = "onnxruntime_onnx"
        stats = ModelStats(name, version)
        self.models[name] = FakeServed(
            name, version, config, FakeScheduler(fn, stats, self.pool, mode=mode), stats, self.model_dir
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
            json_format.Parse(config_json, ModelConfig())  # a bad config is the repository's INVALID_ARG

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))
        if name not in self.models:
            raise not_found(f"failed to unload '{name}', no version is available")

    def close(self) -> None:
        """Stop the worker threads of the repository's pool and of every model's own pool."""
        pools = [self.pool, *(m.scheduler.pool for m in self.models.values())]
        for pool in {id(p): p for p in pools}.values():
            pool.shutdown(wait=False, cancel_futures=True)


def fake_plane(repo: FakeRepository, registry: SharedMemoryRegistry | None = None) -> DataPlane:
    """The real DataPlane over `repo`."""
    return DataPlane(repo, registry or SharedMemoryRegistry())  # type: ignore[arg-type]
