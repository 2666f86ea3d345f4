"""Backends that could run code refuse files that came with a load request on their own, decided by
`BackendOptions.from_load_request` (set by the repository from how the load was asked for), before
any runtime is imported: a TensorRT engine (a plugin embedded in one runs on deserialization) and a
TorchScript program. The repository refuses them first (tests/repository/test_origin.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends.base import BackendOptions
from edgeserve.backends.neuron import BACKEND as NEURON
from edgeserve.backends.tensorrt import BACKEND as TENSORRT
from edgeserve.protocol.errors import InferenceError, Status

SENT = BackendOptions(from_load_request=True)


def test_tensorrt_loads_no_engine_sent_with_a_load_request(tmp_path: Path) -> None:
    before = set(sys.modules)
    for name in ("model.plan", "x.engine"):
        (tmp_path / name).write_bytes(b"\x00engine")
        with pytest.raises(InferenceError) as raised:
            TENSORRT.load(tmp_path / name, mc.ModelConfig(), SENT)
        assert raised.value.status is Status.PERMISSION_DENIED
        assert (
            "engines are executable code" in raised.value.message
            and "send model.onnx" in raised.value.message
        )
    assert "tensorrt" not in set(sys.modules) - before  # refused before the runtime was touched


def test_neuron_loads_no_torchscript_sent_with_a_load_request(tmp_path: Path) -> None:
    before = set(sys.modules)
    (tmp_path / "model.pt").write_bytes(b"PK")
    with pytest.raises(InferenceError) as raised:
        NEURON.load(tmp_path / "model.pt", mc.ModelConfig(), SENT)
    assert raised.value.status is Status.PERMISSION_DENIED and "TorchScript program" in raised.value.message
    assert "torch" not in set(sys.modules) - before
