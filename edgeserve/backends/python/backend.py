"""`PythonBackend`: `backend: "python"` models (`<version>/model.py` with Triton's TritonPythonModel).

The server never imports the user's model.py: its inputs and outputs come from config.pbtxt, or from
the model's `auto_complete_config` staticmethod run in a short-lived worker (`inspect_config`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve.backends.base import BackendOptions, ModelIO, TensorSpec
from edgeserve.backends.python.group import GROUP_PARAMETER, GroupKey, check_group_name, group_key
from edgeserve.backends.python.instance import KILL_GRACE_S, PythonInstance, start_worker
from edgeserve.backends.python.process import Worker, WorkerDied, WorkerSpec, WorkerTimeout
from edgeserve.protocol.datatypes import config_to_protocol
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

HANG_GRACE_S = 2.0  # past the scheduler's hang timeout before the instance kills the worker itself
AUTO_COMPLETE_TIMEOUT_S = 60.0
# model_config.proto fields of 64-bit integer types: protobuf's JSON writes them as strings, Triton's
# args["model_config"] has numbers.
_INT64_FIELDS = frozenset({
    "dims", "shape", "max_queue_delay_microseconds", "default_timeout_microseconds", "priority_levels",
    "default_priority_level", "max_sequence_idle_microseconds", "timeout_action", "max_queue_size",
})  # fmt: skip


def _fix_ints(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _fix_ints(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_fix_ints(v, key) for v in value]
    if key in _INT64_FIELDS and isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def config_dict(config: Any) -> dict[str, Any]:
    """The model config as Triton hands it to a Python model (proto field names, ints as numbers)."""
    from google.protobuf import json_format

    raw = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    fixed: dict[str, Any] = _fix_ints(raw)
    return fixed


def declared_io(config: Any) -> ModelIO:
    """Inputs/outputs from the config; the batch axis is prepended as -1 when max_batch_size > 0."""
    from tritonclient.grpc import model_config_pb2 as mc

    batch = (-1,) if int(config.max_batch_size) > 0 else ()

    def spec(tensor: Any) -> TensorSpec:
        datatype = config_to_protocol(mc.DataType.Name(tensor.data_type))
        return TensorSpec(tensor.name, datatype, batch + tuple(int(d) for d in tensor.dims))

    return ModelIO(tuple(spec(t) for t in config.input), tuple(spec(t) for t in config.output))


def _hang_timeout_s(options: BackendOptions) -> float:
    from edgeserve.backends.options import DEFAULT_HANG_TIMEOUT_S

    text = options.parameters.get("hang_timeout_s", "")
    try:
        return max(0.0, float(text)) if text else DEFAULT_HANG_TIMEOUT_S
    except ValueError:
        return DEFAULT_HANG_TIMEOUT_S


def _check_origin(model_path: Path, options: BackendOptions | None) -> None:
    """The repository refuses this first (repository/origin.py); the backend keeps its own check, decided
    by where the files came from (the options the repository set), not by the folder they are in."""
    if options is None or options.from_load_request:
        source = "files sent with a load request" if options else "files whose origin is not known here"
        raise InferenceError(
            Status.PERMISSION_DENIED,
            f"{model_path}: Python models run only from the local model repository or a signed bundle, "
            f"not from {source}",
        )


def _group(model_path: Path, config: Any, name: str) -> GroupKey | None:
    """The worker group a model's own config puts it in (None: a worker of its own), keyed by where
    its code comes from as well, so code of two origins never shares a process."""
    entry = config.parameters.get(GROUP_PARAMETER) if GROUP_PARAMETER in config.parameters else None
    value = entry.string_value.strip() if entry is not None else ""
    if not value:
        return None
    try:
        return group_key(check_group_name(value, f"model '{name}' config"), model_path)
    except (ValueError, OSError) as exc:
        raise InferenceError(Status.INVALID_ARG, str(exc)) from None


class PythonBackend:
    name = "python"
    platforms: tuple[str, ...] = ()
    artifacts: tuple[str, ...] = ("model.py",)

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()

    def unavailable_reason(self) -> str | None:
        return None  # needs only this interpreter

    def inspect(self, model_path: Path) -> ModelIO:
        """From <model>/config.pbtxt (the model itself is not imported in the server)."""
        from edgeserve.protocol.model_config import parse_pbtxt

        path = model_path.parent.parent / "config.pbtxt"
        if not path.is_file():
            raise InferenceError(
                Status.INVALID_ARG,
                f"{model_path}: a Python model needs a config.pbtxt with its inputs and outputs",
            )
        io, _ = self.inspect_config(model_path, parse_pbtxt(path), str(path))
        return io

    def inspect_config(
        self, model_path: Path, raw_config: Any, where: str, options: BackendOptions | None = None
    ) -> tuple[ModelIO, Any]:
        """The model's signature and its config completed by the model's own `auto_complete_config`
        (run in a worker process when model.py defines one; `options` say where the files came from,
        none: unknown, so the code is not run)."""
        config = raw_config
        try:
            source = model_path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise InferenceError(Status.NOT_FOUND, f"{model_path}: cannot read: {exc}") from None
        if "auto_complete_config" in source:
            _check_origin(model_path, options)
            config = self._auto_complete(model_path, raw_config, where)
        if not config.input or not config.output:
            kind = "inputs" if not config.input else "outputs"
            raise InferenceError(
                Status.INVALID_ARG,
                f"{where}: a Python model declares its {kind} in config.pbtxt (or adds them in "
                "auto_complete_config); none found",
            )
        return declared_io(config), config

    def _auto_complete(self, model_path: Path, raw_config: Any, where: str) -> Any:
        from google.protobuf import json_format
        from tritonclient.grpc import model_config_pb2 as mc

        label = f"{where}: auto_complete_config"
        spec = WorkerSpec(model_path, label, start_timeout_s=AUTO_COMPLETE_TIMEOUT_S)
        worker = Worker(spec)
        try:
            reply = worker.request({"op": "load", "model_file": str(model_path)}, AUTO_COMPLETE_TIMEOUT_S)
            if "error" not in reply:
                reply = worker.request({"op": "auto_complete", "config": config_dict(raw_config)},
                                       AUTO_COMPLETE_TIMEOUT_S)  # fmt: skip
        except (WorkerDied, WorkerTimeout) as exc:
            what = str(exc) or "did not answer"
            raise InferenceError(Status.INTERNAL, f"{label}: the Python worker {what}") from None
        finally:
            with contextlib.suppress(Exception):
                worker.stop(KILL_GRACE_S)
        if "error" in reply:
            raise InferenceError(Status.INVALID_ARG, f"{label} failed: {reply['error']}")
        completed = mc.ModelConfig()
        try:
            json_format.ParseDict(reply["config"], completed)
        except (json_format.ParseError, KeyError, TypeError) as exc:
            raise InferenceError(Status.INVALID_ARG, f"{label} returned a bad config: {exc}") from None
        return completed

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> PythonInstance:
        _check_origin(model_path, options)
        name = config.name or model_path.parent.parent.name
        with self._lock:
            index = next(self._counters.setdefault(name, itertools.count()))
        group = config.instance_group[0] if config.instance_group else None
        kind = "GPU" if group is not None and group.kind == 1 else "CPU"  # KIND_GPU = 1
        device = str(group.gpus[0]) if group is not None and group.gpus else "0"
        version = model_path.parent.name
        args = {
            "model_config": json.dumps(config_dict(config)),
            "model_instance_kind": kind,
            "model_instance_name": f"{name}_{index}",
            "model_instance_device_id": device,
            "model_repository": str(model_path.parent.parent),
            "model_version": version,
            "model_name": name,
        }
        hang = _hang_timeout_s(options)
        label = f"model '{name}' version {version} instance {index}"
        spec = WorkerSpec(model_path, label, args, call_timeout_s=hang + HANG_GRACE_S if hang > 0 else 0.0,
                          group=_group(model_path, config, name),
                          decoupled=bool(config.model_transaction_policy.decoupled))  # fmt: skip
        worker = start_worker(spec)
        return PythonInstance(spec, declared_io(config), worker)


BACKEND = PythonBackend()
