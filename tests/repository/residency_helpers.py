"""Real ONNX models for the memory-budget tests: about 18 MiB each once loaded (a budget of
BUDGET_MB holds two of them), with their numpy reference answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx_models import write_model

HIDDEN = 60_000  # ~5 MB of weights per model
BUDGET_MB = 40  # two of them fit, three do not


def param(key: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "true" }} }}\n'


def make_models(root: Path, names: str, configs: dict[str, str] | None = None) -> Path:
    repo = root / "models"
    for seed, name in enumerate(names):
        write_model(repo, name, "mlp", hidden=HIDDEN, seed=seed, config=(configs or {}).get(name))
    return repo


def reference(repo: Path, name: str, x: np.ndarray) -> np.ndarray:
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(repo / name / "1" / "model.onnx"))
               .graph.initializer}  # fmt: skip
    hidden = np.maximum(x @ weights["w1"] + weights["b1"], 0)
    logits = hidden @ weights["w2"] + weights["b2"]
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True))
