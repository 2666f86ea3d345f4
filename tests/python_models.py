"""A Python-backend model file (model.py) imported in this process, outside any server: to call the
numpy steps of the sample pipelines directly (tests/models, benchmarks/bench_ocr.py); and a small
Python model's config, as load-API JSON and as config.pbtxt text."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

MODELS = Path(__file__).resolve().parents[1] / "models"


def load_model_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python_config(input: tuple[str, str, list[int]], output: tuple[str, str, list[int]]) -> dict[str, Any]:
    """A Python model's config as load-API JSON: one (name, data_type, dims) input and output, no batch
    axis, one CPU instance."""
    return {
        "backend": "python",
        "max_batch_size": 0,
        "input": [dict(zip(("name", "data_type", "dims"), input, strict=True))],
        "output": [dict(zip(("name", "data_type", "dims"), output, strict=True))],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    }


def as_pbtxt(config: dict[str, Any]) -> str:
    """A load-API JSON config as config.pbtxt text."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    return str(text_format.MessageToString(json_format.ParseDict(config, model_config_pb2.ModelConfig())))


def sample_step(name: str) -> ModuleType:
    """models/<name>/1/model.py of the sample repository."""
    return load_model_file(MODELS / name / "1" / "model.py", f"sample_{name}")
