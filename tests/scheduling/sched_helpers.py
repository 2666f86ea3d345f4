"""Helpers for the scheduler tests: a real ONNX Runtime instance, a gate that holds a worker inside
`infer` (so queue contents are known exactly), result collectors and config/job builders."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from edgeserve.backends.base import ModelIO, TensorSpec
from edgeserve.scheduling.job import Job
from edgeserve.scheduling.stats import ModelStats

WAIT_S = 20.0  # upper bound for anything to happen; never reached when the code is right

_ORT_TYPES = {"tensor(float)": "FP32", "tensor(int64)": "INT64", "tensor(int32)": "INT32"}


class OrtInstance:
    """A plain onnxruntime session behind the Instance protocol: the reference answers."""

    def __init__(self, path: Path) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        def spec(arg: Any) -> TensorSpec:
            shape = tuple(d if isinstance(d, int) else -1 for d in arg.shape)
            return TensorSpec(arg.name, _ORT_TYPES.get(arg.type, arg.type), shape)

        self.io = ModelIO(tuple(spec(a) for a in self.session.get_inputs()),
                          tuple(spec(a) for a in self.session.get_outputs()))  # fmt: skip
        self.closed = False

    def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs else [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, dict(inputs)), strict=True))

    def close(self) -> None:
        self.closed = True


class GatedInstance:
    """Wraps an instance: every `infer` records its inputs, signals `entered`, then waits for the gate.
    `fail_on_call[n]` makes the n-th call (1-based) raise that exception instead of running."""

    def __init__(self, inner: Any, open_gate: bool = True) -> None:
        self.inner = inner
        self.io = inner.io
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.calls: list[dict[str, np.ndarray]] = []  # the arrays exactly as the scheduler passed them
        # their values at the call: a batch's gathered input is a pooled buffer the next batch reuses
        self.seen: list[dict[str, np.ndarray]] = []
        self.fail_on_call: dict[int, Exception] = {}
        self.threads: list[str] = []  # the thread each call ran on
        self.max_active = 0  # most calls inside infer() at once (an instance must never exceed 1)
        self._active = 0
        self._count_lock = threading.Lock()
        self._entered = threading.Semaphore(0)
        self.closed = False

    def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        with self._count_lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            self.calls.append(dict(inputs))
            self.seen.append({name: np.array(array, copy=True) for name, array in inputs.items()})
            self.threads.append(threading.current_thread().name)
            number = len(self.calls)
            self._entered.release()
            if not self.gate.wait(WAIT_S):
                raise TimeoutError("test gate never opened")
            if number in self.fail_on_call:
                raise self.fail_on_call[number]
            return self.inner.infer(inputs, outputs)  # type: ignore[no-any-return]
        finally:
            with self._count_lock:
                self._active -= 1

    def wait_entered(self, count: int = 1) -> None:
        for _ in range(count):
            assert self._entered.acquire(timeout=WAIT_S), "the worker never reached infer()"

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class Result:
    """A job callback that remembers what it got and how often it was called."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.value: Any = None
        self.calls = 0
        self.thread: str = ""

    def __call__(self, value: Any) -> None:
        self.calls += 1
        self.value = value
        self.thread = threading.current_thread().name
        self._event.set()

    def get(self, timeout: float = WAIT_S) -> Any:
        assert self._event.wait(timeout), "job never completed"
        return self.value

    def outputs(self) -> dict[str, np.ndarray]:
        value = self.get()
        assert isinstance(value, dict), f"expected outputs, got {value!r}"
        return value

    def error(self) -> BaseException:
        value = self.get()
        assert isinstance(value, BaseException), f"expected an error, got outputs {list(value)}"
        return value


def load_instance(path: Path, config: model_config_pb2.ModelConfig) -> Any:
    """The product's ONNX Runtime backend (one intra-op thread); the local OrtInstance only while that
    module does not exist yet."""
    try:
        from edgeserve.backends.onnxruntime import BACKEND
    except ModuleNotFoundError as exc:
        if exc.name != "edgeserve.backends.onnxruntime":
            raise
        return OrtInstance(path)
    from edgeserve.backends.base import BackendOptions

    return BACKEND.load(path, config, BackendOptions(threads=1))


class GatedSchedulers:
    """Started schedulers (`cls`: Scheduler or SequenceBatcher) over gated real instances; `close()` opens
    every gate and closes every scheduler (a fixture's teardown)."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.made: list[tuple[Any, list[GatedInstance]]] = []

    def start(self, model: str, path: Path, config: model_config_pb2.ModelConfig, instances: int,
              open_gate: bool, **kwargs: Any) -> tuple[Any, list[GatedInstance]]:  # fmt: skip
        gated = [GatedInstance(load_instance(path, config), open_gate) for _ in range(instances)]
        scheduler = self.cls(model, 1, config, list(gated), ModelStats(model, 1), **kwargs)
        scheduler.start()
        self.made.append((scheduler, gated))
        return scheduler, gated

    def close(self) -> None:
        for scheduler, gated in self.made:
            for instance in gated:
                instance.gate.set()
            scheduler.close()


def make_config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def make_job(inputs: dict[str, np.ndarray], *, batching: bool = True, priority: int = 0, timeout_us: int = 0,
             age_s: float = 0.0) -> tuple[Job, Result]:  # fmt: skip
    """A job and its Result; `age_s` backdates the arrival (to test expired timeouts without sleeping)."""
    result = Result()
    rows = next(iter(inputs.values())).shape[0] if batching else 1
    job = Job(inputs=inputs, batch_size=rows, done=result, priority=priority, timeout_us=timeout_us,
              arrival_ns=time.monotonic_ns() - int(age_s * 1e9))  # fmt: skip
    return job, result


def hold_worker(scheduler: Any, instance: GatedInstance, inputs: dict[str, np.ndarray]) -> tuple[Job, Result]:
    """Submit a job and wait until the (gated) worker holds it: what is submitted next queues up."""
    held = make_job(inputs)
    scheduler.submit(held[0])
    instance.wait_entered()
    return held


def submit_all(scheduler: Any, inputs: Sequence[dict[str, np.ndarray]]) -> list[tuple[Job, Result]]:
    jobs = [make_job(one) for one in inputs]
    for job, _ in jobs:
        scheduler.submit(job)
    return jobs


def mlp_input(rows: int = 1, fill: float | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    if fill is not None:
        return {"INPUT0": np.full((rows, 16), fill, dtype=np.float32)}
    return {"INPUT0": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}
