"""Triton's `triton_python_backend_utils` inside a worker (`import triton_python_backend_utils as pb_utils`).

Covered: Tensor (as_numpy, to_dlpack/from_dlpack on CPU tensors, shape, is_cpu), InferenceRequest
(execute()'s requests, and BLS calls: exec, exec(decoupled=True), async_exec), InferenceResponse
(outputs or error), InferenceResponseSender (decoupled models), TritonError with its codes,
TritonModelException, the get_*_by_name helpers, the type maps, Logger, MetricFamily / Metric
(custom metrics), get_model_dir, using_decoupled_model_transaction_policy, the TRITONSERVER_* flags
and the auto-complete `ModelConfig`. Not covered (raise naming themselves): request rescheduling
(set_release_flags), GPU tensors.
"""

from __future__ import annotations

import json
from typing import Any

from edgeserve.backends.python import pb_bls
from edgeserve.backends.python.pb_bls import (
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceRequest,
    InferenceResponseSender,
)
from edgeserve.backends.python.pb_core import (
    Array,
    InferenceResponse,
    Logger,
    Tensor,
    TritonError,
    TritonModelException,
    get_input_tensor_by_name,
    get_output_tensor_by_name,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from edgeserve.backends.python.pb_metrics import MetricFamily

__all__ = [
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "Array",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "Logger",
    "MetricFamily",
    "ModelConfig",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]  # fmt: skip

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


def get_model_dir() -> str:
    """The model's version folder (where model.py is), as Triton's pb_utils.get_model_dir()."""
    link = pb_bls.find_link()
    return link.model_dir if link is not None else ""


def using_decoupled_model_transaction_policy(model_config: Any) -> bool:
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def _config_entry(model_config: Any, kind: str, name: str) -> dict[str, Any] | None:
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    for entry in model_config.get(kind, []) if isinstance(model_config, dict) else []:
        if entry.get("name") == name:
            return dict(entry)
    return None


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "output", name)


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives and fills in."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        config.setdefault("input", [])
        config.setdefault("output", [])

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def max_batch_size(self) -> int:
        return int(self._config.get("max_batch_size", 0))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if int(max_batch_size) < 0:
            raise ValueError("max_batch_size must be >= 0")
        current = self.max_batch_size()
        if current > 0 and current != int(max_batch_size):
            raise ValueError(
                f"configuration specified max_batch_size {current}, but auto-complete-config "
                f"function for model '{self._config.get('name', '')}' specified {max_batch_size}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" in self._config:
            raise ValueError("the config sets sequence_batching; dynamic batching cannot be added")
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        unknown = set(policy) - {"decoupled"}
        if unknown:
            raise ValueError(f"model_transaction_policy has no field {', '.join(sorted(unknown))}")
        current = self._config.get("model_transaction_policy", {}).get("decoupled")
        wanted = bool(policy.get("decoupled", False))
        if current is not None and bool(current) != wanted:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._config.get('name', '')}', which is already set to {current}"
            )
        self._config["model_transaction_policy"] = {"decoupled": wanted}

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        if not isinstance(tensor, dict) or "name" not in tensor:
            raise ValueError(f"add_{kind} needs a dict with at least 'name'")
        for key in ("data_type", "dims"):
            if key not in tensor and kind == "input":
                raise ValueError(f"{kind} '{tensor['name']}' is missing '{key}'")
        new = {k: (list(v) if k == "dims" else v) for k, v in tensor.items()}
        for current in self._config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            for key, value in new.items():
                have = current.get(key)
                if have not in (None, [], "", "TYPE_INVALID") and have != value:
                    raise ValueError(
                        f"{kind} '{tensor['name']}': configuration specified {key} {have}, but "
                        f"auto-complete-config specified {value}"
                    )
                current[key] = value
            return
        self._config[kind].append(new)
