"""AWS Neuron backend: a precompiled TorchScript-Neuron `model.pt` (torch_neuronx.trace + torch.jit.save) on
Inferentia/Trainium NeuronCores.

TorchScript carries no tensor names, so the model's config.pbtxt must declare its inputs and outputs
(Triton's PyTorch convention: tensors are fed positionally in the declared order, e.g. INPUT__0,
OUTPUT__0). Shapes are those the model was compiled for (Neuron compiles for fixed shapes).
NeuronCore placement: parameters { key: "neuron_cores" value: { string_value: "0-1" } } sets
NEURON_RT_VISIBLE_CORES before the first model loads. `torch`/`torch_neuronx` are imported only here.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.backends.base import Array, BackendOptions, ModelIO, TensorSpec
from edgeserve.protocol.datatypes import config_to_protocol
from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger("edgeserve.backends.neuron")


def declared_io(config: Any) -> ModelIO:
    """The config's inputs/outputs as a ModelIO (batch axis prepended as -1 when max_batch_size > 0)."""
    from tritonclient.grpc import model_config_pb2 as mc

    batch = (-1,) if int(getattr(config, "max_batch_size", 0) or 0) > 0 else ()

    def spec(tensor: Any) -> TensorSpec:
        datatype = config_to_protocol(mc.DataType.Name(tensor.data_type))
        return TensorSpec(tensor.name, datatype, batch + tuple(int(d) for d in tensor.dims))

    return ModelIO(tuple(spec(t) for t in config.input), tuple(spec(t) for t in config.output))


def _config_next_to(model_path: Path) -> Any:
    """<model>/config.pbtxt for <model>/<version>/model.pt, or None."""
    from edgeserve.protocol.model_config import parse_pbtxt

    path = model_path.parent.parent / "config.pbtxt"
    return parse_pbtxt(path) if path.is_file() else None


class NeuronInstance:
    def __init__(self, module: Any, io: ModelIO, path: Path) -> None:
        self._module = module
        self.io = io
        self.path = path
        self.fallback_reason: str | None = None

    def infer(self, inputs: Mapping[str, Array], outputs: Sequence[str] | None = None) -> dict[str, Array]:
        import torch

        if self._module is None:
            raise InferenceError(Status.UNAVAILABLE, f"{self.path}: the Neuron model is closed")
        missing = [t.name for t in self.io.inputs if t.name not in inputs]
        if missing:
            raise InferenceError(Status.INVALID_ARG, f"missing input(s) {', '.join(missing)}")
        args = [torch.from_numpy(np.ascontiguousarray(inputs[t.name])) for t in self.io.inputs]
        with torch.inference_mode():
            result = self._module(*args)
        values = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(values) < len(self.io.outputs):
            raise InferenceError(
                Status.INTERNAL,
                f"{self.path}: the model returned {len(values)} tensors, the "
                f"config declares {len(self.io.outputs)} outputs",
            )
        wanted = set(outputs) if outputs else None
        return {
            spec.name: value.detach().cpu().numpy()
            for spec, value in zip(self.io.outputs, values, strict=False)
            if wanted is None or spec.name in wanted
        }

    def close(self) -> None:
        self._module = None


class NeuronBackend:
    name = "neuron"
    platforms: tuple[str, ...] = ("pytorch_libtorch",)
    artifacts: tuple[str, ...] = ("model.pt",)

    def unavailable_reason(self) -> str | None:
        try:
            import torch_neuronx  # noqa: F401
        except ImportError as exc:
            return f"python package 'torch_neuronx' not importable ({exc})"
        if not glob.glob("/dev/neuron[0-9]*"):
            return "no AWS Neuron devices (/dev/neuronN)"
        return None

    def inspect(self, model_path: Path) -> ModelIO:
        config = _config_next_to(model_path)
        if config is None or not config.input or not config.output:
            raise InferenceError(
                Status.INVALID_ARG,
                f"{model_path}: a TorchScript-Neuron model needs config.pbtxt "
                "with its inputs and outputs declared (TorchScript has no tensor names)",
            )
        return declared_io(config)

    def load(self, model_path: Path, config: ModelConfig, options: BackendOptions) -> NeuronInstance:
        if options.from_load_request:  # the repository refuses it first (repository/origin.py)
            raise InferenceError(
                Status.PERMISSION_DENIED,
                f"{model_path}: a TorchScript program runs only from the local model repository or a "
                "signed bundle, not from files sent with a load request",
            )
        cores = options.parameters.get("neuron_cores")
        if cores and "NEURON_RT_VISIBLE_CORES" not in os.environ:
            os.environ["NEURON_RT_VISIBLE_CORES"] = (
                cores  # read by the Neuron runtime at its first model load
            )
        import torch
        import torch_neuronx  # noqa: F401  (registers the Neuron ops TorchScript needs)

        if options.threads > 0:
            torch.set_num_threads(options.threads)
        try:
            module = torch.jit.load(str(model_path))
        except Exception as exc:
            raise InferenceError(
                Status.INVALID_ARG,
                f"{model_path}: not a loadable TorchScript-Neuron model "
                f"(compile it with torch_neuronx.trace and torch.jit.save): {exc}",
            ) from exc
        module.eval()
        io = declared_io(config) if config.input else self.inspect(model_path)
        log.info(
            "%s: loaded on Neuron (%s)", model_path, os.environ.get("NEURON_RT_VISIBLE_CORES", "all cores")
        )
        return NeuronInstance(module, io, model_path)


BACKEND = NeuronBackend()
