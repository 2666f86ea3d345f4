"""ONNX Runtime backend: `model.onnx` on CPU, or on TensorRT / CUDA / OpenVINO execution providers.

Session options are tuned for small devices: one inter-op thread, sequential execution, the CPU
memory arena as the memory profile says (standard: on for fixed shapes, it saves re-faulting
activations per call; small: off, it keeps peak RSS forever) and no spinning worker threads (they
burn an idle box's CPU), unless the model's parameters ask otherwise. `onnxruntime` is imported only
in here.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends import memory
from edgeserve.backends.base import Array, BackendOptions, ModelIO, TensorSpec, ensure_contiguous
from edgeserve.backends.cache import runtime_folder
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger("edgeserve.backends.onnxruntime")

CPU = "CPUExecutionProvider"
# Providers that keep compiled engines in options.cache_dir and load them back by themselves.
CACHING_PROVIDERS = frozenset({"TensorrtExecutionProvider", "OpenVINOExecutionProvider"})
THREADS_PARAMETER = "intra_op_thread_count"  # Triton's ORT backend parameter
SMALL_MODEL_NS = 300_000  # per call at batch 1; above it the plan's threads are kept untimed
SIZE_RUNS = 3  # enough to tell a small model from a large one
PROBE_RUNS = 20
PROBE_GAP_S = 0.0005
# A small model keeps its thread pool only when that is at least 10% faster than one thread: the pool's
# wake-ups and spinning cost CPU that the frontends of a small box need, for little or no gain.
POOL_GAIN = 0.9

# ORT type strings -> protocol datatypes. BF16 is left out on purpose: the ORT Python API cannot
# hand bfloat16 tensors to or from numpy.
ORT_TYPES: dict[str, str] = {
    "tensor(float)": "FP32", "tensor(float16)": "FP16", "tensor(double)": "FP64",
    "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(bool)": "BOOL", "tensor(string)": "BYTES",
}  # fmt: skip

# Short names accepted in options.providers / device profiles.
PROVIDER_ALIASES: dict[str, str] = {
    "tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider", "openvino": "OpenVINOExecutionProvider",
    "cpu": CPU, "coreml": "CoreMLExecutionProvider", "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider", "dnnl": "DnnlExecutionProvider", "acl": "ACLExecutionProvider",
    "armnn": "ArmNNExecutionProvider", "xnnpack": "XnnpackExecutionProvider", "qnn": "QNNExecutionProvider",
}  # fmt: skip

# ORT exception class names that mean "the model file is at fault" rather than the runtime.
_BAD_MODEL_ERRORS = {
    "InvalidProtobuf",
    "NoSuchFile",
    "InvalidGraph",
    "InvalidArgument",
    "NoModel",
    "NotFound",
}


def _status_of(exc: BaseException) -> Status:
    return Status.INVALID_ARG if type(exc).__name__ in _BAD_MODEL_ERRORS else Status.INTERNAL


def provider_name(name: str) -> str:
    return PROVIDER_ALIASES.get(name.lower(), name)


def _dims(shape: Any) -> tuple[int, ...]:
    """ORT shapes hold ints, symbolic names (str) or None; anything not a fixed size becomes -1."""
    if shape is None:
        return ()
    return tuple(int(d) if isinstance(d, int) and d >= 0 else -1 for d in shape)


def _spec(arg: Any, what: str, path: Path) -> TensorSpec:
    datatype = ORT_TYPES.get(arg.type)
    if datatype is None:
        raise InferenceError(
            Status.INVALID_ARG,
            f"{path}: {what} '{arg.name}' has type {arg.type}, which edgeserve's onnxruntime backend "
            f"does not serve (supported: {', '.join(sorted(set(ORT_TYPES.values())))})",
        )
    return TensorSpec(arg.name, datatype, _dims(arg.shape))


def _model_io(session: Any, path: Path) -> ModelIO:
    return ModelIO(
        inputs=tuple(_spec(a, "input", path) for a in session.get_inputs()),
        outputs=tuple(_spec(a, "output", path) for a in session.get_outputs()),
    )


def _model_file(path: Path) -> Path:
    # Triton allows `model.onnx` to be a directory holding model.onnx plus its external data files.
    return path / "model.onnx" if path.is_dir() else path


def session_options(options: BackendOptions, dynamic_shapes: bool = False) -> Any:
    """`dynamic_shapes`: the model's inputs have dynamic dims, so the memory pattern is off by default
    (ORT plans one block per input shape and keeps each plan: memory for nothing when shapes vary; it
    ran slower here too)."""
    import onnxruntime as ort

    params = options.parameters
    so = ort.SessionOptions()
    threads = options.threads
    if params.get(THREADS_PARAMETER, "").isdigit():
        threads = int(params[THREADS_PARAMETER])
    so.intra_op_num_threads = max(0, threads)  # 0 = ORT default (one per physical core)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    arena = params.get("ort_memory_arena", params.get("enable_mem_arena", memory.ort_memory_arena(None)))
    # "auto" (the standard profile, backends/memory.py): on where shapes are fixed, so the arena keeps
    # one set of blocks; with dynamic dims it would keep the peak of every shape seen
    auto = arena.strip().lower() == "auto"
    so.enable_cpu_mem_arena = not dynamic_shapes if auto else _truthy(arena)
    so.enable_mem_pattern = _truthy(params.get("ort_memory_pattern", "false" if dynamic_shapes else "true"))
    spinning = "1" if _truthy(params.get("ort_allow_spinning", "false")) else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    so.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    for key, value in params.items():  # raw ORT session config entries pass straight through
        if key.startswith("session."):
            so.add_session_config_entry(key, value)
    so.log_severity_level = 3  # ORT's own warnings are noisy; we report fallbacks ourselves
    return so


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _provider_options(provider: str, options: BackendOptions) -> dict[str, str]:
    device_id = options.device.partition(":")[2] or "0"
    if provider == "CUDAExecutionProvider":
        return {"device_id": device_id}
    if provider == "TensorrtExecutionProvider":
        opts = {"device_id": device_id}
        if options.precision in ("fp16", "auto"):
            opts["trt_fp16_enable"] = "True"
        if options.precision == "int8":
            opts["trt_int8_enable"] = "True"
        if options.cache_dir is not None:
            opts["trt_engine_cache_enable"] = "True"
            opts["trt_engine_cache_path"] = str(options.cache_dir)
        return opts
    if provider == "OpenVINOExecutionProvider":
        device = options.device.split(":")[0].upper()
        opts = {"device_type": device if device in ("CPU", "GPU", "NPU", "AUTO") else "CPU"}
        if options.precision in ("fp32", "fp16"):
            opts["precision"] = options.precision.upper()
        if options.cache_dir is not None:
            opts["cache_dir"] = str(options.cache_dir)
        return opts
    return {}


def plan_providers(requested: Sequence[str], available: Sequence[str]) -> tuple[list[str], list[str]]:
    """(providers to use, CPU last) and the requested ones this onnxruntime build lacks."""
    chosen: list[str] = []
    missing: list[str] = []
    for raw in requested:
        name = provider_name(raw)
        if name == CPU or name in chosen:
            continue
        if name in available:
            chosen.append(name)
        else:
            missing.append(name)
    chosen.append(CPU)
    return chosen, missing


class OnnxRuntimeInstance:
    """One InferenceSession. `fallback_reason` says why it runs on CPU although more was asked for."""

    def __init__(self, session: Any, io: ModelIO, path: Path, fallback_reason: str | None) -> None:
        self._session: Any = session
        self.io = io
        self.path = path
        self.fallback_reason = fallback_reason
        self.providers: tuple[str, ...] = tuple(session.get_providers())
        self._string_inputs = {t.name for t in io.inputs if t.datatype == "BYTES"}
        self._string_outputs = {t.name for t in io.outputs if t.datatype == "BYTES"}
        self._output_names = [t.name for t in io.outputs]
        self.weights_bytes = _files_bytes(path)
        self.threads = 0  # intra-op threads it runs with; 0 = ORT's default
        self.threads_note: str | None = None  # what the load-time thread probe measured and chose
        self.tuned_parameters: dict[str, str] = {}  # config parameters that reproduce the probe's choice

    def infer(self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        session = self._session
        if session is None:
            raise InferenceError(Status.UNAVAILABLE, f"{self.path}: the onnxruntime session is closed")
        feed: dict[str, Array] = {}
        for name, array in inputs.items():
            feed[name] = (
                _to_ort_strings(name, array) if name in self._string_inputs else ensure_contiguous(array)
            )
        names = list(outputs) if outputs else self._output_names
        try:
            results = session.run(names, feed)
        except Exception as exc:
            raise InferenceError(
                _status_of(exc), f"onnxruntime failed to run {self.path.name}: {exc}"
            ) from exc
        out: dict[str, Array] = {}
        for name, value in zip(names, results, strict=True):
            array = np.asarray(value)
            out[name] = _from_ort_strings(array) if name in self._string_outputs else array
        return out

    def memory_estimate(self) -> dict[str, int]:
        """The model's file(s) as the weights it holds (ORT may hold a prepacked copy besides; with the
        CPU arena off, activations are freed after each call)."""
        return {"weights": self.weights_bytes} if self._session is not None else {}

    def close(self) -> None:
        self._session = None  # a run in flight keeps its own reference and finishes


def _files_bytes(path: Path) -> int:
    """The model file and its external data files (all files beside it in its folder of model.onnx/)."""
    folder = path.parent if path.parent.name == "model.onnx" else None
    files = [p for p in folder.iterdir() if p.is_file()] if folder is not None else [path]
    total = 0
    for file in files:
        try:
            total += file.stat().st_size
        except OSError:
            continue
    return total


def has_dynamic_inputs(config: Any) -> bool:
    """True when the config declares a dynamic (-1) input dim (beyond the batch axis it adds)."""
    try:
        return any(-1 in list(t.dims) for t in config.input)
    except (AttributeError, TypeError):
        return False


def _to_ort_strings(name: str, array: Array) -> Array:
    """Our BYTES tensors are object arrays of `bytes`; ORT string tensors want `str` (UTF-8)."""
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=np.object_)
    for i, item in enumerate(flat):
        if isinstance(item, (bytes, bytearray, memoryview)):
            try:
                out[i] = bytes(item).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InferenceError(
                    Status.INVALID_ARG,
                    f"input '{name}': element {i} is not UTF-8 text, which onnxruntime string tensors "
                    f"need ({exc})",
                ) from None
        else:
            out[i] = str(item)
    return out.reshape(array.shape)


def _from_ort_strings(array: Array) -> Array:
    flat = array.reshape(-1)
    out = np.empty(flat.shape, dtype=np.object_)
    for i, item in enumerate(flat):
        out[i] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out.reshape(array.shape)


class OnnxRuntimeBackend:
    name = "onnxruntime"
    platforms: tuple[str, ...] = ("onnxruntime_onnx",)
    artifacts: tuple[str, ...] = ("model.onnx",)

    def unavailable_reason(self) -> str | None:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            return f"onnxruntime is not installed: {exc}"
        return None

    def available_providers(self) -> list[str]:
        import onnxruntime as ort

        return list(ort.get_available_providers())

    def _session(self, path: Path, so: Any, providers: list[Any]) -> Any:
        import onnxruntime as ort

        file = _model_file(path)
        try:
            return ort.InferenceSession(str(file), sess_options=so, providers=providers)
        except Exception as exc:
            raise InferenceError(
                _status_of(exc), f"{file}: onnxruntime cannot load the model: {exc}"
            ) from exc

    def inspect(self, model_path: Path) -> ModelIO:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only the signature
        so.enable_cpu_mem_arena = False
        so.log_severity_level = 3
        session = self._session(model_path, so, [CPU])
        return _model_io(session, _model_file(model_path))

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> OnnxRuntimeInstance:
        available = self.available_providers()
        chosen, missing = plan_providers(options.providers, available)
        reasons: list[str] = []
        if missing:
            reasons.append(
                f"requested execution provider(s) {', '.join(missing)} not in this onnxruntime build "
                f"(available: {', '.join(available)})"
            )
        providers: list[Any] = [(p, _provider_options(p, options)) if p != CPU else p for p in chosen]
        dynamic = has_dynamic_inputs(config)
        so = session_options(options, dynamic)
        cached = options.cache_dir if CACHING_PROVIDERS & set(chosen) else None
        with runtime_folder(cached, "onnxruntime's cached engine"):  # the providers load what is there
            session = self._session(model_path, so, providers)
        active = list(session.get_providers())
        dropped = [p for p in chosen if p != CPU and p not in active]
        if dropped:
            reasons.append(f"execution provider(s) {', '.join(dropped)} failed to initialise")
        fallback = None
        if reasons:
            fallback = "; ".join(reasons) + f"; running on {', '.join(active)}"
            log.warning("%s: CPU fallback: %s", _model_file(model_path), fallback)
        file = _model_file(model_path)
        io = _model_io(session, file)
        threads, note = int(so.intra_op_num_threads), None
        if active == [CPU] and THREADS_PARAMETER not in options.parameters and threads != 1:
            session, threads, note = self._tune_threads(model_path, session, threads, options, io, dynamic)
        instance = OnnxRuntimeInstance(session, io, file, fallback)
        instance.threads, instance.threads_note = threads, note
        if note is not None and threads == 1:
            instance.tuned_parameters = {THREADS_PARAMETER: "1"}
        return instance

    def _tune_threads(
        self, model_path: Path, session: Any, threads: int, options: BackendOptions, io: ModelIO,
        dynamic: bool = False,
    ) -> tuple[Any, int, str | None]:  # fmt: skip
        """Time the session, and for a small model a one-thread session too; one thread unless the pool
        is clearly faster."""
        feed = probe_feed(io)
        if feed is None or (os.cpu_count() or 1) < 2:
            return session, threads, None
        try:
            if time_runs([session], feed, SIZE_RUNS)[0] >= SMALL_MODEL_NS:
                return session, threads, None
            so = session_options(options, dynamic)
            so.intra_op_num_threads = 1
            single = self._session(model_path, so, [CPU])
            pool_ns, single_ns = time_runs([session, single], feed, PROBE_RUNS)
        except Exception as exc:  # the probe is an optimisation: the warm-up reports real failures
            log.info("%s: thread probe skipped: %s", model_path, exc)
            return session, threads, None
        pool = f"{threads} threads" if threads else "the default threads"
        timings = f"{single_ns / 1e3:.0f} us per call with 1 thread, {pool_ns / 1e3:.0f} us with {pool}"
        if pool_ns < single_ns * POOL_GAIN:
            return session, threads, f"kept {pool} ({timings})"
        return single, 1, f"1 intra-op thread for this small model ({timings})"


def probe_feed(io: ModelIO) -> dict[str, Array] | None:
    """Zeros for every input (batch axis 1); None when a shape beyond the batch axis is dynamic."""
    feed: dict[str, Array] = {}
    for spec in io.inputs:
        dims = list(spec.shape)
        if dims and dims[0] == -1:
            dims[0] = 1
        if -1 in dims or spec.datatype == "BYTES":
            return None
        feed[spec.name] = np.zeros(dims, dtype=datatypes.numpy_dtype(spec.datatype))
    return feed


def time_runs(sessions: Sequence[Any], feed: Mapping[str, Array], runs: int) -> list[int]:
    """Median nanoseconds per call of each session, taken in turns, each call after an idle gap: a
    request that finds the runtime idle is what a small model's latency is made of (a thread pool
    that has gone to sleep must be woken), not back-to-back calls."""
    for session in sessions:
        session.run(None, feed)  # the first run allocates
    times: list[list[int]] = [[] for _ in sessions]
    for _ in range(runs):
        for session, mine in zip(sessions, times, strict=True):
            time.sleep(PROBE_GAP_S)
            start = time.perf_counter_ns()
            session.run(None, feed)
            mine.append(time.perf_counter_ns() - start)
    return [int(statistics.median(mine)) for mine in times]


BACKEND = OnnxRuntimeBackend()
