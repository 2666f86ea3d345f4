"""TensorRT backend (TensorRT 10 API): runs a `model.plan`, or builds and caches an engine from `model.onnx`.

Name-based I/O (`num_io_tensors`, `get_tensor_name`, `set_input_shape`, `set_tensor_address`,
`execute_async_v3`); device memory and a stream per instance through cuda-python's runtime API.
Dynamic shapes run through the engine's optimization profile. When no usable plan is there, an
engine is built from ONNX in a child process (progress in the log) and cached under
`options.cache_dir`, keyed by GPU/SoC, compute capability, TensorRT version, precision, profile
shapes and the ONNX hash, and sealed: a cached engine is deserialized only from bytes verified against
what edgeserve wrote (backends/trt_engine.py, backends/cache.py). `tensorrt` and `cuda` are imported
only here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends import trt_engine
from edgeserve.backends.base import Array, BackendOptions, ModelIO, TensorSpec, ensure_contiguous
from edgeserve.backends.cache import Rejected
from edgeserve.fsutil import sha256_file
from edgeserve.protocol.datatypes import BF16_DTYPE, from_numpy
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger("edgeserve.backends.tensorrt")
_build_lock = threading.Lock()  # one engine build at a time: builds take most of a small device's memory


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # cuda-python < 12.6
        from cuda import cudart
    return cudart


def _check(result: Any, what: str) -> Any:
    """cuda-python calls return (err, *values); raise on error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise InferenceError(Status.INTERNAL, f"CUDA {what} failed: {getattr(err, 'name', err)}")
    return values[0] if len(values) == 1 else tuple(values)


def _np_dtype(trt: Any, dtype: Any) -> np.dtype[Any]:
    if str(dtype).endswith("BF16"):
        if BF16_DTYPE is None:
            raise InferenceError(Status.UNSUPPORTED, "a bf16 engine tensor needs ml_dtypes")
        return BF16_DTYPE
    result: np.dtype[Any] = np.dtype(trt.nptype(dtype))
    return result


def _model_io(trt: Any, engine: Any) -> ModelIO:
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        spec = TensorSpec(
            name,
            from_numpy(_np_dtype(trt, engine.get_tensor_dtype(name))),
            tuple(int(d) for d in engine.get_tensor_shape(name)),
        )
        (inputs if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outputs).append(spec)
    return ModelIO(tuple(inputs), tuple(outputs))


class TensorRTInstance:
    """One execution context + stream; infer is called one call at a time (from any thread: the
    runtime API makes the device's primary context current on each)."""

    def __init__(self, trt: Any, engine: Any, path: Path, fallback_reason: str | None = None) -> None:
        self._trt, self._engine, self.path = trt, engine, path
        self._cudart = _cudart()
        self._context = engine.create_execution_context()
        if self._context is None:
            raise InferenceError(
                Status.RESOURCE_EXHAUSTED, f"{path}: cannot create a TensorRT execution context"
            )
        self._stream = _check(self._cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.io = _model_io(trt, engine)
        self.fallback_reason = fallback_reason
        tensors = (*self.io.inputs, *self.io.outputs)
        self._dtypes = {t.name: _np_dtype(trt, engine.get_tensor_dtype(t.name)) for t in tensors}
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes), grow-only

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self._buffers.get(name, (0, 0))
        if nbytes > size:
            if ptr:
                _check(self._cudart.cudaFree(ptr), "cudaFree")
            ptr = int(_check(self._cudart.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})"))
            self._buffers[name] = (ptr, nbytes)
        return ptr

    def infer(self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        if self._context is None:
            raise InferenceError(Status.UNAVAILABLE, f"{self.path}: the TensorRT model is closed")
        cudart, ctx, stream = self._cudart, self._context, self._stream
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        keep: list[Array] = []  # host arrays must live until the stream is synchronized
        for spec in self.io.inputs:
            if spec.name not in inputs:
                raise InferenceError(Status.INVALID_ARG, f"input '{spec.name}' is missing")
            array = ensure_contiguous(
                np.asarray(inputs[spec.name]).astype(self._dtypes[spec.name], copy=False)
            )
            if not ctx.set_input_shape(spec.name, tuple(array.shape)):
                shapes = (
                    self._engine.get_tensor_profile_shape(spec.name, 0)
                    if -1 in spec.shape
                    else [spec.shape] * 3
                )
                raise InferenceError(
                    Status.INVALID_ARG,
                    f"input '{spec.name}' shape {list(array.shape)} is outside the engine's profile "
                    f"(min {list(shapes[0])}, max {list(shapes[2])})",
                )
            ptr = self._buffer(spec.name, array.nbytes)
            _check(cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, h2d, stream), "copy in")
            ctx.set_tensor_address(spec.name, ptr)
            keep.append(array)
        results: dict[str, Array] = {}
        for spec in self.io.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(spec.name))
            host = np.empty(shape, dtype=self._dtypes[spec.name])
            ptr = self._buffer(spec.name, host.nbytes)
            ctx.set_tensor_address(spec.name, ptr)
            results[spec.name] = host
        if not ctx.execute_async_v3(int(stream)):
            raise InferenceError(Status.INTERNAL, f"{self.path}: TensorRT execute_async_v3 failed")
        for name, host in results.items():
            _check(
                cudart.cudaMemcpyAsync(host.ctypes.data, self._buffers[name][0], host.nbytes, d2h, stream),
                "copy out",
            )
        _check(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        del keep
        wanted = set(outputs) if outputs else None
        return {k: v for k, v in results.items() if wanted is None or k in wanted}

    def close(self) -> None:
        for ptr, _ in self._buffers.values():
            self._cudart.cudaFree(ptr)
        self._buffers.clear()
        if self._context is not None:
            self._cudart.cudaStreamDestroy(self._stream)
        self._context = None
        self._engine = None


def device_identity() -> trt_engine.DeviceIdentity:
    """This box's GPU as the engine cache sees it (CUDA device 0, plus the Jetson SoC/L4T if any)."""
    from edgeserve.hardware.probes import FsRoot
    from edgeserve.hardware.probes.nvidia import probe_jetson

    cudart = _cudart()
    device = int(os.environ.get("EDGESERVE_CUDA_DEVICE", "0"))
    props = _check(cudart.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    jetson = probe_jetson(FsRoot("/"))
    soc, l4t = (jetson.soc, jetson.l4t) if jetson else (None, None)
    return trt_engine.DeviceIdentity(name.strip("\x00 "), f"{props.major}.{props.minor}", soc, l4t)


class TensorRTBackend:
    name = "tensorrt"
    platforms: tuple[str, ...] = ("tensorrt_plan",)
    artifacts: tuple[str, ...] = ("model.plan", "model.onnx")

    def unavailable_reason(self) -> str | None:
        try:
            import tensorrt as trt
        except ImportError as exc:
            return f"python package 'tensorrt' not importable ({exc})"
        major = int(str(trt.__version__).split(".")[0])
        if major < 10:
            return (
                f"TensorRT {trt.__version__} is older than 10.0 (this backend uses the TensorRT 10 I/O API)"
            )
        try:
            cudart = _cudart()
        except ImportError as exc:
            return f"cuda-python not importable ({exc})"
        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0:
            return f"no usable CUDA device ({getattr(err, 'name', err)})"
        if count == 0:
            return "no CUDA device"
        return None

    def _runtime(self, options: BackendOptions) -> tuple[Any, Any]:
        import tensorrt as trt

        logger = trt.Logger(trt.Logger.WARNING)
        trt.init_libnvinfer_plugins(logger, "")
        runtime = trt.Runtime(logger)
        if options.device.upper().startswith("DLA"):
            runtime.DLA_core = int(options.device.partition(":")[2] or 0)
        return trt, runtime

    def _deserialize(self, runtime: Any, plan: Path, data: bytes | None = None) -> Any:
        try:
            return runtime.deserialize_cuda_engine(plan.read_bytes() if data is None else data)
        except (OSError, RuntimeError, TypeError) as exc:
            log.warning("%s: cannot deserialize: %s", plan, exc)
            return None

    def _engine_from_onnx(self, onnx: Path, config: Any, options: BackendOptions) -> tuple[Path, bytes]:
        """(the cached engine's path, its verified bytes), built first when none is cached."""
        import tensorrt as trt

        spec = trt_engine.spec_from_config(config, options.precision, options.device)
        identity = device_identity()
        digest = sha256_file(onnx)
        key = trt_engine.cache_key(digest, identity, trt.__version__, spec)
        expected = trt_engine.manifest_for(digest, identity, trt.__version__, spec)
        cache = trt_engine.EngineCache(options.cache_dir or onnx.parent / ".engines")
        plan = cache.plan_path(key)
        found = cache.lookup(key, expected)
        if found is not None:
            log.info("%s: using cached engine %s", onnx, plan.name)
            return plan, found
        with _build_lock:
            found = cache.lookup(key, expected)  # another instance may have built it meanwhile
            if found is not None:
                return plan, found
            cache.root.mkdir(parents=True, exist_ok=True)
            partial = cache.root / f".{key}.building"
            trt_engine.build_in_subprocess(
                onnx, partial, spec, lambda line: log.info("%s: %s", onnx.name, line)
            )
            return plan, cache.store(key, partial, expected)

    def inspect(self, model_path: Path) -> ModelIO:
        if model_path.suffix == ".onnx":
            return _onnx_io(model_path)
        trt, runtime = self._runtime(BackendOptions())
        engine = self._deserialize(runtime, model_path)
        if engine is None:
            onnx = model_path.with_name("model.onnx")
            if onnx.exists():
                return _onnx_io(onnx)
            raise InferenceError(
                Status.INVALID_ARG,
                f"{model_path}: not a TensorRT {trt.__version__} engine for this GPU "
                "(engines are tied to the TensorRT version and GPU)",
            )
        return _model_io(trt, engine)

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> TensorRTInstance:
        if options.from_load_request and model_path.suffix != ".onnx":
            # An engine is executable code (a plugin embedded in it runs on deserialization); the
            # repository refuses it first (repository/origin.py). From ONNX the engine is built here.
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"{model_path}: a TensorRT engine sent with a load request is not loaded (engines are "
                "executable code); send model.onnx and the server builds the engine",
            )
        trt, runtime = self._runtime(options)
        fallback = None
        engine = None
        if model_path.suffix != ".onnx":
            engine = self._deserialize(runtime, model_path)
            onnx = model_path.with_name("model.onnx")
            if engine is None and not onnx.exists():
                raise InferenceError(
                    Status.UNAVAILABLE,
                    f"{model_path}: TensorRT {trt.__version__} cannot load this engine (built for another "
                    "TensorRT version or GPU) and there is no model.onnx to rebuild it from",
                )
            if engine is None:
                fallback = f"{model_path.name} does not fit this TensorRT/GPU; rebuilt from model.onnx"
                model_path = onnx
        if engine is None:
            try:
                plan, data = self._engine_from_onnx(model_path, config, options)
            except ValueError as exc:  # profile shapes
                raise InferenceError(Status.INVALID_ARG, f"{model_path}: {exc}") from exc
            except (RuntimeError, Rejected, OSError) as exc:
                raise InferenceError(Status.INTERNAL, f"{model_path}: {exc}") from exc
            engine = self._deserialize(runtime, plan, data)
            if engine is None:
                raise InferenceError(Status.INTERNAL, f"{plan}: a freshly built engine failed to deserialize")
        return TensorRTInstance(trt, engine, model_path, fallback)


def _onnx_io(path: Path) -> ModelIO:
    """Inputs/outputs of an ONNX file without TensorRT (needs the `onnx` package)."""
    try:
        import onnx
        from onnx import helper
    except ImportError as exc:
        raise InferenceError(
            Status.UNAVAILABLE, f"{path}: reading ONNX I/O needs the onnx package ({exc})"
        ) from exc
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}

    def spec(value: Any) -> TensorSpec:
        tensor = value.type.tensor_type
        dims = tuple(int(d.dim_value) if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
        return TensorSpec(
            value.name, from_numpy(np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))), dims
        )

    return ModelIO(
        tuple(spec(v) for v in graph.input if v.name not in initializers),
        tuple(spec(v) for v in graph.output),
    )


BACKEND = TensorRTBackend()
