"""Neuron backend: config-declared I/O and errors run everywhere; loading a TorchScript-Neuron model runs
only where torch_neuronx imports and /dev/neuronN exists (skipped with the reason otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeserve.backends.neuron import BACKEND, declared_io
from edgeserve.protocol.errors import InferenceError
from edgeserve.repository.config import parse_text

CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1000 ] } ]
"""
NEURON_REASON = BACKEND.unavailable_reason()


def test_contract() -> None:
    assert (BACKEND.name, BACKEND.platforms, BACKEND.artifacts) == (
        "neuron",
        ("pytorch_libtorch",),
        ("model.pt",),
    )


def test_declared_io() -> None:
    io = declared_io(parse_text(CONFIG, "t"))
    assert [(t.name, t.datatype, t.shape) for t in io.inputs] == [("INPUT__0", "FP32", (-1, 3, 224, 224))]
    assert io.outputs[0].shape == (-1, 1000)


def test_inspect_reads_the_config_next_to_the_model(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"x")
    with pytest.raises(InferenceError, match=r"needs config\.pbtxt"):
        BACKEND.inspect(tmp_path / "m" / "1" / "model.pt")
    (tmp_path / "m" / "config.pbtxt").write_text(CONFIG)
    assert BACKEND.inspect(tmp_path / "m" / "1" / "model.pt").inputs[0].name == "INPUT__0"


def test_unavailable_reason_here() -> None:
    if NEURON_REASON is not None:
        assert "torch_neuronx" in NEURON_REASON or "Neuron devices" in NEURON_REASON


@pytest.mark.skipif(NEURON_REASON is not None, reason=f"Neuron path: {NEURON_REASON}")
def test_runs_a_traced_model(tmp_path: Path) -> None:  # pragma: no cover - needs an Inferentia host
    import numpy as np
    import torch
    import torch_neuronx

    from edgeserve.backends.base import BackendOptions

    model = torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.Softmax(dim=-1)).eval()
    traced = torch_neuronx.trace(model, torch.zeros(1, 16))
    torch.jit.save(traced, str(tmp_path / "model.pt"))
    config = parse_text(
        'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]\n'
        'output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1, 4 ] } ]',
        "t",
    )
    instance = BACKEND.load(tmp_path / "model.pt", config, BackendOptions(device="NEURON", precision="auto"))
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    out = instance.infer({"INPUT__0": x})["OUTPUT__0"]
    np.testing.assert_allclose(out, model(torch.from_numpy(x)).detach().numpy(), rtol=2e-2, atol=1e-3)
