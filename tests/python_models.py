"""A Python-backend model file (model.py) imported in this process, outside any server: to call the
numpy steps of the sample pipelines directly (tests/models, benchmarks/bench_ocr.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

MODELS = Path(__file__).resolve().parents[1] / "models"


def load_model_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_step(name: str) -> ModuleType:
    """models/<name>/1/model.py of the sample repository."""
    return load_model_file(MODELS / name / "1" / "model.py", f"sample_{name}")
