"""Shared helpers for the hardware tests: fixture trees, a small model repository, settings."""

from __future__ import annotations

import shutil
from pathlib import Path

from edgeserve.config import Settings
from edgeserve.samples import build_mlp

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "devices" / "fixtures"
PROFILES = ROOT / "devices"

TORCH_CONFIG = """
name: "torch"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 1, 16 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 1, 4 ] } ]
"""


def copy_fixture(name: str, dest: Path) -> Path:
    target = dest / name
    shutil.copytree(FIXTURES / name, target, symlinks=True)
    return target


def make_repository(dest: Path) -> Path:
    """big (256 KiB ONNX), tiny (3 KiB ONNX), engine (model.plan + model.onnx), torch (model.pt + config)."""
    repo = dest / "repo"
    build_mlp(repo / "big" / "1" / "model.onnx", in_features=256, hidden=256, out_features=8)
    build_mlp(repo / "tiny" / "1" / "model.onnx")
    build_mlp(repo / "engine" / "1" / "model.onnx")
    (repo / "engine" / "1" / "model.plan").write_bytes(b"ftrt-not-a-real-engine")
    (repo / "torch" / "1").mkdir(parents=True)
    (repo / "torch" / "1" / "model.pt").write_bytes(b"PK-not-a-real-torchscript")
    (repo / "torch" / "config.pbtxt").write_text(TORCH_CONFIG)
    return repo


def settings(tmp: Path, **runtime: object) -> Settings:
    s = Settings()
    s.server.state_dir = tmp / "state"
    for key, value in runtime.items():
        setattr(s.runtime, key, value)
    return s
