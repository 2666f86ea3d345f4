"""The slow model of the overload tests (test_admission_e2e.py, test_overload_refusal_e2e.py): a
MatMul+Tanh chain on one CPU instance, max_batch_size 1, so a flood of requests overloads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient
from onnx_models import build_matmul_chain
from tritonclient.utils import InferenceServerException

DIM = 256


def slow_repo(tmp_path: Path, layers: int, weights: int, config: str = "") -> Path:
    """`layers` set how slow a row is; `config`: more config.pbtxt lines (a queue policy)."""
    repo = tmp_path / "repo"
    build_matmul_chain(repo / "slow" / "1" / "model.onnx", layers, DIM, weights=weights)
    head = 'backend: "onnxruntime"\nmax_batch_size: 1\n'
    one_instance = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
    (repo / "slow" / "config.pbtxt").write_text(head + config + one_instance)
    return repo


async def grpc_outcome(client: grpcclient.InferenceServerClient, x: np.ndarray) -> tuple[str, str]:
    """("OK", "") or the status and message the server answered one request to "slow" with."""
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    try:
        await client.infer("slow", [inp], client_timeout=60)
    except InferenceServerException as exc:
        return str(exc.status()), str(exc.message())
    return "OK", ""
